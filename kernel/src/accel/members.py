"""How a :class:`accel.Kernel` offers what its parts do.

A Kernel holds its parts as objects (the collectives on nested data, the trackers' calls, the checkpoints, the
dataloader arguments) instead of inheriting them from mixins. Each public member a part answers is declared on the
Kernel with one line: ``gather = Forward("_ops", ProcessOps.gather)`` reads ``kernel._ops.gather``, and
``split_batches: Attribute[bool] = Attribute("_arguments")`` reads (and assigns) ``kernel._arguments.split_batches``.
The member keeps the part's docstring, so ``help(accel.Kernel)`` documents it, and mypy types it from the part's
signature. As with a plain method, ``Kernel.gather`` is a function of a Kernel (``Kernel.gather(kernel, tensor)``,
what a wrapper patched onto the class calls), a subclass that overrides a member (accel-accelerate's
``Accelerator.gather``) is called instead, and its ``super().gather(...)`` reaches the part.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")
T = TypeVar("T")


def _part(kernel: Any, part: str, member: str) -> Any:
    """The part of ``kernel`` called ``part``; a Kernel without it (one unpickled in another process) raises its own
    line for ``member``."""
    found = kernel.__dict__.get(part)
    if found is None:
        kernel.__getattr__(member)  # raises the Kernel's AttributeError for the member
    return found


class Forward(Generic[S, P, R]):
    """A Kernel method that is a method of one of its parts (see the module)."""

    def __init__(self, part: str, method: Callable[Concatenate[S, P], R]) -> None:
        self.part = part
        self.method = method
        self.name = method.__name__
        self.__doc__ = method.__doc__

        def function(kernel: Any, /, *args: Any, **kwargs: Any) -> Any:
            return getattr(_part(kernel, part, self.name), method.__name__)(*args, **kwargs)

        #: what ``Kernel.<name>`` is: a function of a Kernel, as a method's would be (``Kernel.gather(kernel, t)``,
        #: a wrapper that calls the original); its name, docstring and signature are the part's method's
        self.function = functools.wraps(method)(function)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, kernel: None, owner: type) -> Callable[Concatenate[S, P], R]: ...

    @overload
    def __get__(self, kernel: object, owner: type | None = None) -> Callable[P, R]: ...

    def __get__(self, kernel: object, owner: type | None = None) -> Any:
        if kernel is None:
            return self.function
        return getattr(_part(kernel, self.part, self.name), self.method.__name__)


class Attribute(Generic[T]):
    """A Kernel attribute that is the same-named attribute (or property) of one of its parts (see the module).
    Assigning it assigns the part's, which decides what it accepts; a ``readonly`` one refuses."""

    def __init__(self, part: str, doc: str | None = None, *, readonly: bool = False) -> None:
        self.part = part
        self.name = ""
        self.readonly = readonly
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, kernel: None, owner: type) -> Attribute[T]: ...

    @overload
    def __get__(self, kernel: object, owner: type | None = None) -> T: ...

    def __get__(self, kernel: object, owner: type | None = None) -> Any:
        if kernel is None:
            return self
        return getattr(_part(kernel, self.part, self.name), self.name)

    def fget(self, kernel: object) -> T:
        """As ``property.fget``: the value on ``kernel`` (``Kernel.split_batches.fget(kernel)``)."""
        return self.__get__(kernel)

    def fset(self, kernel: object, value: T) -> None:
        """As ``property.fset``: assign on ``kernel``, what a subclass's setter calls
        (``Kernel.dataloader_config.fset(self, value)``)."""
        self.__set__(kernel, value)

    def __set__(self, kernel: object, value: T) -> None:
        if self.readonly:
            raise AttributeError(f"kernel.{self.name} cannot be set: it is a fact of the run")
        setattr(_part(kernel, self.part, self.name), self.name, value)
