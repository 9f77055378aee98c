"""Which optimizer a step belongs to, where several step through one scaler (manual optimization: a GAN's generator
and discriminator share Lightning's one GradScaler). One optimizer needs none of this: its steps carry no index and
cost nothing more."""

from __future__ import annotations

from typing import Any, Sequence


def optimizer_index(optimizers: Sequence[Any]) -> dict[int, int] | None:
    """``id(optimizer) -> its position`` among the run's optimizers, or None with fewer than two."""
    if len(optimizers) < 2:
        return None
    return {id(opt): i for i, opt in enumerate(optimizers)}


def describe_optimizers(optimizers: Sequence[Any], module: Any) -> tuple[str, ...]:
    """Each optimizer in a few words, by its class and the parameters it steps: "Adam over disc.*"."""
    names: dict[int, str] = {}
    named = getattr(module, "named_parameters", None)
    if callable(named):
        names = {id(p): n for n, p in named()}
    out = []
    for opt in optimizers:
        prefixes: list[str] = []
        for group in getattr(opt, "param_groups", ()):
            for p in group.get("params", ()):
                name = names.get(id(p))
                if name is None:
                    continue
                head = name.split(".", 1)[0] + (".*" if "." in name else "")
                if head not in prefixes:
                    prefixes.append(head)
        cls = type(opt).__name__
        if not prefixes:
            out.append(cls)
            continue
        shown = ", ".join(prefixes[:3])
        out.append(f"{cls} over {shown}{', ...' if len(prefixes) > 3 else ''}")
    return tuple(out)


class Optimizers:
    """The optimizers the step hook sits on (a callback may swap in new ones: checked at log steps and on an
    anomalous step, never per step) and, where the run has several, which one is stepping.

    ``ids``: ``id(optimizer) -> its index`` (None with one); ``current``: the index of the one whose step is being
    taken (set by the route before each optimizer steps); ``names``: each one in a few words. Once a second one steps
    (``several``), each step is resolved with its optimizer's index (no fast path): one scaler's skips are then each
    optimizer's own (the machine keeps each one's safe scale apart)."""

    def __init__(self) -> None:
        self.attached: tuple[Any, ...] = ()
        self.ids: dict[int, int] | None = None
        self.current: int | None = None
        self.names: tuple[str, ...] = ()
        self.several = False

    def attach(self, optimizers: Sequence[Any], module: Any) -> None:
        """The optimizers the hook sits on from now on, their indices and names (``module``'s parameter names)."""
        self.attached = tuple(optimizers)
        self.ids = optimizer_index(self.attached)
        self.names = () if self.ids is None else describe_optimizers(self.attached, module)
        self.several = self.several and self.ids is not None

    def swapped(self, optimizers: Sequence[Any]) -> bool:
        """Whether ``optimizers`` are not those the hook sits on."""
        attached = self.attached
        return len(optimizers) != len(attached) or any(a is not b for a, b in zip(optimizers, attached))

    def index(self, optimizer: Any) -> int | None:
        """The index of ``optimizer``, about to step (None for one it does not know, or with one optimizer); the
        first time a second one steps, :attr:`several` becomes true."""
        index = self.ids.get(id(optimizer)) if self.ids is not None else None
        if index is not None and not self.several and self.current is not None and index != self.current:
            self.several = True
        return index

    def clear(self) -> None:
        """None attached, none stepping (the fit's start and end); the names stay, as the machine was told them."""
        self.attached, self.ids, self.current, self.several = (), None, None, False
