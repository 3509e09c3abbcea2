"""Waiting queues of the scheduler: FCFS (a deque) and priority (a heap).

Follows vLLM V1's ``v1/core/sched/request_queue.py``. Both hold WAITING and PREEMPTED
requests. Under FCFS a preempted request goes back to the front (it was admitted before
everything still waiting); under priority every request is ordered by
``Request.sort_key = (priority, arrival_time, request_id)``, smaller first.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from jaxserve.core.request import Request


class FCFSRequestQueue:
    """First come, first served."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        """A new request joins the tail."""
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        """A preempted request goes to the front."""
        self._queue.appendleft(request)

    def peek(self) -> Request:
        """The next request (IndexError when empty)."""
        return self._queue[0]

    def pop(self) -> Request:
        """Removes and returns the front request (IndexError when empty)."""
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        """Removes ``request``; O(n), for aborts.

        Raises:
          ValueError: if ``request`` is not in the queue (from ``deque.remove``).
        """
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Most urgent first: by ``(priority, arrival_time, request_id)``."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, Request]] = []

    def add(self, request: Request) -> None:
        """Inserts ``request`` by its ``sort_key`` (O(log n))."""
        heapq.heappush(self._heap, (request.sort_key, request))

    def add_preempted(self, request: Request) -> None:
        """Preempted requests keep their original key (they are not sent to the back)."""
        heapq.heappush(self._heap, (request.sort_key, request))

    def peek(self) -> Request:
        """The most urgent request (IndexError when empty)."""
        return self._heap[0][1]

    def pop(self) -> Request:
        """Removes and returns the most urgent request (IndexError when empty)."""
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        """Removes ``request`` (matched by identity); O(n), for aborts.

        Raises:
          ValueError: if ``request`` is not in the queue.
        """
        for i, (_, r) in enumerate(self._heap):
            if r is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id!r} is not waiting")

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In heap order (not sorted)."""
        return (r for _, r in self._heap)


def make_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    """The waiting queue of a scheduling policy.

    Args:
      policy: "fcfs" or "priority" (``SchedulerConfig.policy``, vLLM's ``--scheduling-policy``).

    Raises:
      ValueError: for any other policy.
    """
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"scheduling_policy must be fcfs or priority, got {policy!r}")
