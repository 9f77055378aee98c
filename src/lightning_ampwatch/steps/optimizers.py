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
