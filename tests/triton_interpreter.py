"""Triton's interpreter without its redundant re-patching of triton.language.

A kernel launch in the interpreter patches the builtins of the triton.language modules
its kernel's globals name (tl, tl.core) for the launch, and restores them after it. A
call of a jit'd function from inside the kernel (wait_for_inputs, attend_tiles, tl.zeros)
patches those of its own globals again, once per program, even when the launch's patch
already holds, and nothing restores that second patch. That costs more than most programs
of the tests' tiny models compute. Here a call made during a launch patches only the
modules the launch has not, and the launch restores those too: the kernels run the same
code on the same interpreted builtins."""

from __future__ import annotations

import functools
import inspect

import triton.language as tl
from triton.runtime import interpreter


@functools.cache
def _languages(fn) -> frozenset[str]:
    """The triton.language modules that interpreter._patch_lang patches for fn."""
    return frozenset(
        value.__name__
        for value in fn.__globals__.values()
        if inspect.ismodule(value) and value in (tl, tl.core)
    )


def patch_once_per_launch() -> None:
    patch_lang = interpreter._patch_lang
    scopes: list = []  # the running launch's patch, then those of its calls
    patched: set[str] = set()

    def patch_unless_held(fn):
        languages = _languages(fn)
        if scopes and languages <= patched:
            return scopes[0]
        scope = patch_lang(fn)
        patched.update(languages)
        scopes.append(scope)
        if len(scopes) == 1:  # a launch: its restore ends it and restores the calls' too
            restore = scope.restore

            def restore_all() -> None:
                for inner in reversed(scopes[1:]):
                    inner.restore()
                scopes.clear()
                patched.clear()
                restore()

            scope.restore = restore_all
        return scope

    interpreter._patch_lang = patch_unless_held
