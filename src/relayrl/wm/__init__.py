"""``relayrl wm``: the world model's offline half. ``collect`` records out-of-distribution real
episodes, ``pretrain`` trains the observation and success models on them, ``eval`` measures the
models against held-out real episodes and the real env (docs/world_model.md)."""
