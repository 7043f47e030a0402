"""Prepare a run's data, before and apart from training: sources -> regeneration (keeping the target
features training will read) -> the prepared mixture, with its manifest.

    python -m train.prepare --config configs/testbed.yaml [section.key=value ...]
    accelerate launch -m train.prepare --config ...     # every process regenerates its share of the prompts

Give it the config and overrides the training run will get: it builds the same artifact, under
`<cache>/datasets/mixture-<key>/` (the key covers the sources' content, the target's content fingerprint
and the generation settings): `dataset/`, `manifest.json` (sources and their counts, the target's
fingerprint, chat template and thinking setting, generation settings, quarantine counts),
`sources_quarantine.jsonl` (the records of the user's sources that were not used, each with its reason)
and `quarantine.jsonl` (prompts regeneration refused). A killed preparation resumes. Training reads the
artifact, and builds it through this same code when it is missing (the one-command quickstart).
Its last line of output is the manifest, as one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta

from configs.schema import ConfigError, PipelineConfig, load_config


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/testbed.yaml", help="YAML config (the training run's)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, the training run's")
    return parser.parse_args(argv)


def prepare(config: PipelineConfig) -> dict:
    """Build (or resume) the stage-1 mixture of this config; returns its manifest."""
    import torch
    from accelerate import PartialState

    from data.mixture import MANIFEST, mixture_dir
    from drafters.target_loading import load_target_config
    from train.setup import cache_root, drafter_layer_ids, resolve_target, training_dataset

    if config.data.dataset is not None or config.train.stage != "general":
        raise ValueError("train.prepare builds the regenerated stage-1 mixture (train.stage general, no data.dataset); "
                         "stage 2 reads data.trajectories as training starts")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    state = PartialState(cpu=not torch.cuda.is_available(), timeout=timedelta(hours=12))  # a share can take hours
    target_path = resolve_target(config, log)
    layer_ids = drafter_layer_ids(config, target_path, load_target_config(target_path, config.target.trust_remote_code))
    training_dataset(config, target_path, state, layer_ids)
    return json.loads((mixture_dir(config, target_path, cache_root(config)) / MANIFEST).read_text())


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        manifest = prepare(load_config(args.config, args.overrides))
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(manifest, default=str), flush=True)


if __name__ == "__main__":
    main()
