"""Domains and rewards by name, so configs can name user code without changing rlpt.

A name is either registered (``register_domain("my_dom", factory)``) or an
import path ``pkg.module:attr`` (``attr`` may be dotted). ``family/arg`` calls a
registered factory ``family`` with ``arg`` as its first argument, e.g.
``reasoning_gym/chain_sum``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from rlpt.tasks.base import Domain

_DOMAINS: dict[str, Callable[..., Domain]] = {}
_REWARDS: dict[str, Any] = {}


def register_domain(name: str, factory: Callable[..., Domain], *, overwrite: bool = False) -> None:
    """Make ``get_domain(name, **kwargs)`` return ``factory(**kwargs)``."""
    _register(_DOMAINS, "domain", name, factory, overwrite)


def register_reward(name: str, fn: Any, *, overwrite: bool = False) -> None:
    """Register a reward function ``fn(task, completion, result) -> float`` or a class of them."""
    _register(_REWARDS, "reward", name, fn, overwrite)


def registered_domains() -> list[str]:
    return sorted(_DOMAINS)


def registered_rewards() -> list[str]:
    return sorted(_REWARDS)


def get_domain(name_or_path: str | Domain, **kwargs: Any) -> Domain:
    """A domain from a registered name, ``family/arg``, or ``pkg.module:attr``.

    ``attr`` may be a ``Domain`` instance (returned as is) or a class or factory
    (called with ``kwargs``).
    """
    if isinstance(name_or_path, Domain):
        return name_or_path
    obj, args = _lookup(_DOMAINS, "domain", name_or_path)
    if isinstance(obj, Domain):
        if kwargs or args:
            raise ValueError(f"{name_or_path} is a Domain instance; it takes no arguments")
        return obj
    domain = obj(*args, **kwargs)
    if not isinstance(domain, Domain):
        raise TypeError(f"{name_or_path} made a {type(domain).__name__}, not a Domain")
    return domain


def get_reward(name_or_path: str | Callable[..., float], **kwargs: Any) -> Callable[..., float]:
    """A reward function from a registered name or ``pkg.module:attr``.

    A class (or, with ``kwargs``, any factory) is called to make the function.
    """
    if callable(name_or_path) and not isinstance(name_or_path, str):
        return name_or_path
    obj, args = _lookup(_REWARDS, "reward", name_or_path)
    if isinstance(obj, type) or kwargs or args:
        return obj(*args, **kwargs)
    return obj


def _register(table: dict[str, Any], kind: str, name: str, obj: Any, overwrite: bool) -> None:
    if not name or ":" in name or "/" in name:
        raise ValueError(f"invalid {kind} name {name!r}: it must be non-empty, without ':' or '/'")
    if name in table and table[name] is not obj and not overwrite:
        raise ValueError(f"{kind} {name!r} is already registered; pass overwrite=True to replace")
    table[name] = obj


def _lookup(table: dict[str, Any], kind: str, name: str) -> tuple[Any, tuple[str, ...]]:
    if name in table:
        return table[name], ()
    if ":" in name:
        return _import(name, kind), ()
    family, sep, arg = name.partition("/")
    if sep and family in table:
        return table[family], (arg,)
    raise ValueError(
        f"unknown {kind} {name!r}; registered {kind}s: {', '.join(sorted(table)) or '(none)'}; "
        "or give an import path 'pkg.module:attr'"
    )


def _import(path: str, kind: str) -> Any:
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {kind} {path!r}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise ValueError(f"cannot import {kind} {path!r}: no attribute {part!r}") from e
    return obj
