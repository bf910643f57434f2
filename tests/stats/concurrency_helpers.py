"""Run a writer and readers of a collector at once; the readers' failures surface in the test."""

from __future__ import annotations

import threading


def run_writer_and_readers(writer, reader, num_readers: int = 2) -> None:
    """Start writer() and num_readers x reader(errors) together, join them, and fail with the
    first exception a reader appended to `errors`."""
    errors: list[BaseException] = []
    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(errors,))
                                                   for _ in range(num_readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
