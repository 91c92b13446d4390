"""ninfer runtime: memory plan, kernels and the engine; `model.ReferenceModel` is the torch oracle."""
