"""The feature capture half of `python -m train.prepare`, kept under its earlier name.

    accelerate launch -m train.capture_job --config configs/testbed.yaml [section.key=value ...]

It runs the same preparation (train/prepare.py: the dataset if missing, then this rank's share of the
offline feature cache) and prints only the capture report, one JSON line per rank.
"""

from __future__ import annotations

import sys

from configs.schema import ConfigError, PipelineConfig, load_config
from train.prepare import emit_json_line, engine_logs_to_stderr, parse_args, prepare


def capture(config: PipelineConfig) -> dict:
    if config.features.mode != "offline":
        raise ValueError("features.mode is online: training runs the target itself and reads no cache; "
                         "set features.mode=offline to capture one")
    return prepare(config)["features"]


def main(argv=None) -> None:
    args = parse_args(argv)
    engine_logs_to_stderr()
    try:
        report = capture(load_config(args.config, args.overrides))
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    emit_json_line(report)


if __name__ == "__main__":
    main()
