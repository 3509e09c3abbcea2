"""Pallas kernels for jaxserve."""
