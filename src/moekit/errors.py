"""The one exception type a user sees: the CLI prints its message on one line and exits 2."""


class MoekitError(Exception):
    """Bad input or an impossible request, stated so the user can fix it. Never a bug."""


class SpecError(MoekitError):
    """A config.json that cannot be described: missing or nonsense fields, unknown model_type."""


class CheckpointError(MoekitError):
    """A checkpoint folder that cannot be loaded: missing shard, truncated file, wrong shape."""


class ExpertIntegrityError(MoekitError):
    """An offloaded expert's bytes on disk no longer match the checksums they were recorded with."""
