"""Kernels compiled with numba, once per process, in a background thread.

A kernel here speeds up what a numpy path already answers (same answers): the
index Score's prefix walk (``kvstore.indexer.walk``) and the presence table's
probes (``kvstore.presence``). numba is optional (the ``router`` extra installs
it; vLLM depends on it): without it, with the kernel's off switch set to ``0``,
or if the compile fails, the numpy path answers; also while it compiles.

Why in a thread, not at the first use: a compile is ~1-2 s (~0.5 s from numba's
on-disk cache) on a quiet machine but took 20 s at load 10 on 2 cores; a
process held that long in one call (an index built mid-run, an engine's first
lookup) missed its peers' deadlines. In a thread it only shares the
interpreter lock, and the numpy path answers until it is done.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any


class CompiledKernel:
    """One kernel, ``name`` in the log: ``build()`` imports numba and compiles it (or
    loads numba's cache), returning the callable; ``off_env`` set to ``0`` turns it
    off; ``fallback`` says what answers without it."""

    def __init__(
        self,
        build: Callable[[], Any],
        *,
        name: str,
        off_env: str,
        fallback: str,
        log: logging.Logger,
    ) -> None:
        self._build = build
        self.off_env = off_env
        self.name = name
        self._fallback = fallback
        self._log = log
        self.kernel: Any = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._done = threading.Event()

    def start(self) -> None:
        """Compile in the background, once per process (idempotent)."""
        with self._lock:
            if self._thread is not None or self._done.is_set():
                return
            if os.environ.get(self.off_env, "1") == "0":
                self._log.info("%s=0: %s", self.off_env, self._fallback)
                self._done.set()
                return
            self._thread = threading.Thread(
                target=self._compile, name=f"compile-{self.off_env.lower()}", daemon=True
            )
            self._thread.start()

    def _compile(self) -> None:
        try:
            self.kernel = self._build()
            self._log.info("%s is compiled", self.name)
        except ImportError:
            self._log.info("numba is not installed: %s", self._fallback)
        except Exception as e:  # a compile or cache failure: the numpy path answers
            self._log.warning("%s could not be compiled (%s): %s", self.name, e, self._fallback)
        finally:
            self._done.set()

    def ready(self) -> bool:
        """Whether the kernel answers now (never waits)."""
        return self.kernel is not None

    def available(self, timeout_s: float | None = None) -> bool:
        """Whether the kernel answers once its compile is done (started here if it was
        not; waits up to ``timeout_s``, None: until done)."""
        self.start()
        self._done.wait(timeout_s)
        return self.ready()

    @contextlib.contextmanager
    def switched_off(self) -> Iterator[None]:
        """The fallback answers inside the block (tests and A/B measurements in one
        process; the off switch works per process, at the compile's start)."""
        kernel, self.kernel = self.kernel, None
        try:
            yield
        finally:
            self.kernel = kernel
