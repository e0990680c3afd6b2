"""Training the draft head: data, losses, the jitted step, checkpoints, the loop."""
