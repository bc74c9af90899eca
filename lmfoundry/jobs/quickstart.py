"""The whole lifecycle on one machine: sample corpus -> curate -> pack -> pretrain -> evaluate -> serve.

    lmfoundry quickstart --workdir work/quickstart            # about 5 minutes on 2 CPU cores
    lmfoundry quickstart --keep-serving                       # leave the API running afterwards

Every stage writes under the work directory; a rerun skips the stages already committed there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pydantic import Field

from lmfoundry.clients.openai import OpenAIClient
from lmfoundry.data.curate import CurateConfig, run_curate
from lmfoundry.data.pack import PackConfig, run_pack
from lmfoundry.data.sample_corpus import build_sample_corpus
from lmfoundry.eval.suite import EvaluateConfig, run_evaluate
from lmfoundry.platform import storage
from lmfoundry.platform.config import ConfigError, StageConfig, apply_overrides, build_config, read_recipe
from lmfoundry.platform.log import get_logger
from lmfoundry.serving.app import ServeConfig
from lmfoundry.train.config import PretrainConfig
from lmfoundry.train.pretrain import run_pretrain

logger = get_logger(__name__)
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


class SampleCorpusConfig(StageConfig):
    num_clean_docs: int = Field(1500, ge=10)
    shards: int = Field(4, ge=1)
    seed: int = 0


class QuickstartConfig(StageConfig):
    workdir: str
    corpus: SampleCorpusConfig = SampleCorpusConfig()
    curate: CurateConfig
    pack: PackConfig
    pretrain: PretrainConfig
    evaluate: EvaluateConfig
    serve: ServeConfig
    prompt: str = "Return the number of items in a container."


def with_paths(data: dict, workdir: str) -> dict:
    """Each stage reads the previous stage's directory under `workdir`; paths given in the recipe win."""
    w = storage.normalize(workdir)
    paths = {
        "curate": {"input": f"{w}/raw", "output": f"{w}/curated"},
        "pack": {"input": f"{w}/curated", "output": f"{w}/packed"},
        "pretrain": {"data": f"{w}/packed", "output": f"{w}/pretrain"},
        "evaluate": {"checkpoint": f"{w}/pretrain", "data": f"{w}/packed", "output": f"{w}/eval"},
        "serve": {"checkpoint": f"{w}/pretrain"},
    }
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    data["workdir"] = w
    for stage, defaults in paths.items():
        section = data.setdefault(stage, {}) or {}
        if not isinstance(section, dict):
            raise ConfigError(f"quickstart config: key {stage!r} must be a section of keys")
        for key, value in defaults.items():
            section.setdefault(key, value)
        data[stage] = section
    return data


def load_quickstart_config(path: str | None, workdir: str | None, overrides: list[str]) -> QuickstartConfig:
    source = path or (str(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else None)
    raw = apply_overrides(read_recipe(source) if source else {}, overrides)
    workdir = workdir or raw.get("workdir") or "work/quickstart"
    return build_config(QuickstartConfig, with_paths(raw, workdir), source=source or "<defaults>")


def ask(url: str, key: str, model: str, prompt: str) -> dict:
    with OpenAIClient(url, model, key) as client:
        return client.chat([{"role": "user", "content": prompt}], max_tokens=48, temperature=0.0)


def run_quickstart(cfg: QuickstartConfig, keep_serving: bool = False) -> dict:
    from ray import serve

    from lmfoundry.platform.keys import create_key, env_keys
    from lmfoundry.serving.app import start

    w = cfg.workdir
    print(f"lmfoundry quickstart: work directory {w}", flush=True)
    figures: dict[str, dict] = {}

    def stage(n: int, name: str, fn):
        print(f"\n=== [{n}/6] {name} ===", flush=True)
        t = time.time()
        out = fn()
        figures[name] = {"seconds": round(time.time() - t, 1), **out}
        return out

    def corpus() -> dict:
        raw = f"{w}/raw"
        if storage.is_committed(raw):
            return storage.read_manifest(raw)["details"]
        storage.prepare_output(raw, overwrite=True)
        details = build_sample_corpus(raw, cfg.corpus.num_clean_docs, cfg.corpus.seed, cfg.corpus.shards)
        storage.commit(raw, "sample_corpus", {"details": details})
        return details

    stage(1, "sample corpus", corpus)
    rep = stage(2, "curate", lambda: run_curate(cfg.curate))
    figures["curate"] = {
        "seconds": figures["curate"]["seconds"],
        "documents_in": rep["documents_in"],
        "documents_kept": rep["documents_kept"],
        "rejected_by_reason": rep["rejected_by_reason"],
    }
    man = stage(3, "pack", lambda: run_pack(cfg.pack))
    figures["pack"] = {
        "seconds": figures["pack"]["seconds"],
        "vocab_size": man["vocab_size"],
        "train_sequences": man["splits"]["train"]["sequences"],
        "seq_len": man["seq_len"],
    }
    run = stage(4, "pretrain", lambda: run_pretrain(cfg.pretrain))
    figures["pretrain"] = {
        "seconds": figures["pretrain"]["seconds"],
        "steps": run["steps"],
        "first_loss": round(run["first_loss"], 3),
        "final_loss": round(run["final_loss"], 3),
    }
    ev = stage(5, "evaluate", lambda: run_evaluate(cfg.evaluate))
    shards = ev["language_modelling"]["token_shards"]
    figures["evaluate"] = {
        "seconds": figures["evaluate"]["seconds"],
        "val_perplexity": round(shards["perplexity"], 2),
        "uniform_perplexity": shards["uniform_perplexity"],
    }

    def serve_and_ask() -> dict:
        key = (env_keys(cfg.serve.api_keys_env) or [None])[0]
        if key is None and cfg.serve.keys_file:
            key, _ = create_key(cfg.serve.keys_file, "quickstart")
        url, generated = start(cfg.serve)
        key = key or generated
        reply = ask(url, key, cfg.serve.model_name, cfg.prompt)
        print(f"POST {url}/v1/chat/completions  user: {cfg.prompt!r}")
        print(f"assistant: {reply['choices'][0]['message']['content']!r}  usage: {reply['usage']}")
        return {"url": url, "finish_reason": reply["choices"][0]["finish_reason"]}

    stage(6, "serve", serve_and_ask)
    # what each stage wrote, as a hash of its content: two runs of the same recipe and seed on
    # the same world size and machine type print the same lines (docs/reproducibility.md)
    for name, stage_dir in (
        ("curate", cfg.curate.output),
        ("pack", cfg.pack.output),
        ("pretrain", cfg.pretrain.output),
    ):
        figures[name]["fingerprint"] = storage.read_manifest(stage_dir).get("fingerprint", "none recorded")
    storage.write_json_atomic(f"{w}/quickstart.json", figures)
    print("\n=== summary ===")
    for name, fig in figures.items():
        print(f"{name:14s} {json.dumps(fig)}")
    print("\nfingerprints (equal across runs of the same recipe and seed on the same world size and machine type)")
    for name in ("curate", "pack", "pretrain"):
        print(f"  {name:10s} {figures[name]['fingerprint'][:16]}")
    print(f"\nartifacts under {w}")
    if keep_serving:
        print(f"serving at {figures['serve']['url']}/v1; Ctrl-C stops", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    serve.shutdown()
    return figures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="lmfoundry quickstart", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("config", nargs="?", help=f"quickstart recipe (default {DEFAULT_CONFIG.name})")
    p.add_argument("--workdir", help="where every stage writes (default work/quickstart)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--keep-serving", action="store_true", help="leave the API running at the end")
    p.add_argument("--address", help="Ray cluster address (default: an embedded local Ray)")
    args = p.parse_args(argv)
    try:
        cfg = load_quickstart_config(args.config, args.workdir, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from lmfoundry.platform.ray_env import init_ray

    init_ray(args.address)
    run_quickstart(cfg, args.keep_serving)
    return 0


if __name__ == "__main__":
    sys.exit(main())
