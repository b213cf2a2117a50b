"""Calls from a lower layer into a higher one, without an import that climbs.

`engine`'s imports only go down (the layer table is in `tests/test_layers.py`). Where a lower layer
must run code that belongs to a higher one - `QuantizedTensor`'s FSDP2 all-gather and the linear
layers' path for DTensors live in `engine.distributed` - the lower layer declares a `Hook` and calls
it, and the higher layer registers the implementation when it is imported. `import engine` imports
every layer, so each hook is set before user code runs; one that is not raises, naming who sets it.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Hook(Generic[F]):
    """One function that the module `provider` (above the caller's layer) registers at its import."""

    def __init__(self, name: str, provider: str) -> None:
        self.name = name
        self.provider = provider
        self._impl: F | None = None

    def register(self, impl: F) -> F:
        """Set the implementation (again on a re-import of the provider); returns it, so it can decorate."""
        if not callable(impl):
            raise TypeError(f"{self.name}: expected a callable, got {type(impl).__name__}")
        self._impl = impl
        return impl

    @property
    def registered(self) -> bool:
        return self._impl is not None

    @property
    def impl(self) -> F:
        """The registered function; RuntimeError naming the provider when it has not been imported."""
        if self._impl is None:
            raise RuntimeError(f"{self.name} is provided by {self.provider}, which has not been imported "
                               f"(`import engine` imports it)")
        return self._impl

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.impl(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Hook({self.name!r}, provider={self.provider!r}, registered={self.registered})"
