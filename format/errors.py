"""Exceptions raised by the artifact layer; each message is one line naming the problem."""


class ArtifactError(ValueError):
    """The file violates the .nfer container, format or layout specification."""


class QuantizationError(ValueError):
    """A tensor cannot be encoded in the requested format (non-finite input, scale overflow)."""


class ConvertError(ValueError):
    """The source checkpoint or the conversion options cannot produce a valid artifact."""


class BindingError(ValueError):
    """The artifact's inventory does not match what the model described by its config needs."""
