"""The .nfer artifact: container framing, tensor formats, layouts and quantizers."""

from .container import Artifact, ArtifactPlan, ArtifactWriter
from .errors import ArtifactError, BindingError, ConvertError, QuantizationError

__all__ = ["Artifact", "ArtifactPlan", "ArtifactWriter", "ArtifactError", "BindingError", "ConvertError", "QuantizationError"]
