"""The benchmark that compares AR, DFlash, DDTree and JetFlow side by side: `python -m jetflow_jax.bench`."""
