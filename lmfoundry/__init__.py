"""lmfoundry: raw text to a served model on Ray (curate, pack, pretrain, evaluate, serve)."""

__version__ = "0.1.0"
