"""Ray Train + DeepSpeed pretraining: config, DeepSpeed config derivation, the worker loop."""
