"""Which prompts a disaggregated router has computed on a decode instance rather than a
prefill instance: those of at most max_local_prefill_tokens tokens. Such a prompt costs a
decode step little, less than a transfer's round trip and a wait in a prefill instance's
queue. The client's router (frontend/disaggregated_client.py) and the in-process ones
(disaggregated.py, threaded_router.py) share the rule."""

from __future__ import annotations


def local_prefill_limit(max_local_prefill_tokens: int | None) -> int:
    """The longest prompt computed on a decode instance (0: none) for the option's value
    (None: none); ValueError naming a value below 1."""
    if max_local_prefill_tokens is None:
        return 0
    if max_local_prefill_tokens < 1:
        raise ValueError(
            f"max_local_prefill_tokens must be at least 1, got {max_local_prefill_tokens}"
        )
    return max_local_prefill_tokens
