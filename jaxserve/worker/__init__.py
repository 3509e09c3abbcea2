"""Model runner side: batch builder, jitted step and on-device sampler."""
