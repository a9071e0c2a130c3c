"""Reading ahead in a thread: the planned requests are built while the engine starts and runs.

`prefetch` reads an iterator ahead (at most N items waiting); errors surface where the item would
have been, and the thread stops when the reader closes, drops or finishes it.
"""
from __future__ import annotations


def prefetch(items, max_items: int) -> "Prefetched":
    """Read `items` ahead in a thread (at most max_items waiting), starting now: reading the input
    then overlaps with starting the engine. Errors surface where the item would have been."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=max(max_items, 1))
    stop = threading.Event()  # the thread holds this, not the Prefetched: dropped, that can stop it

    def put(entry) -> bool:
        while not stop.is_set():
            try:
                q.put(entry, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False  # the reader went away: stop reading

    def fill() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((Prefetched.DONE, None))
        except BaseException as exc:  # handed to the reader, raised there
            put((Prefetched.DONE, exc))

    thread = threading.Thread(target=fill, name="runner-input", daemon=True)
    thread.start()
    return Prefetched(q, stop, thread)


class Prefetched:
    """The items prefetch reads ahead, as an iterator; close() (also at the end, on an error, and
    when dropped) stops the reading thread, whether or not anything was read: a run that fails
    before its first row must not leave the thread reading (and asking the database) behind it."""

    DONE = object()

    def __init__(self, q, stop, thread):
        self.q, self.stop, self.thread = q, stop, thread

    def __iter__(self) -> "Prefetched":
        return self

    def __next__(self):
        if self.stop.is_set():
            raise StopIteration
        item, exc = self.q.get()
        if exc is not None:
            self.close()
            raise exc
        if item is Prefetched.DONE:
            self.close()
            raise StopIteration
        return item

    def close(self, wait_s: float = 1.0) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(wait_s)  # it notices within one put's timeout, or after the item in hand

    def __del__(self) -> None:
        self.stop.set()
