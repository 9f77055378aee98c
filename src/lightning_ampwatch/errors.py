"""The errors raised in one layer and caught in another, in a module that imports nothing of the package: the
DeepSpeed adapter (``deepspeed_state``) refuses a remedy with the same :class:`RemedyError` the remedies raise,
without importing the remedies (which import the guards, the signals and so the adapter back)."""


class RemedyError(RuntimeError):
    """A remedy could not be applied here (e.g. bf16 on a device without it); the next allowed rung is tried."""
