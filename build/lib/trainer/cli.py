"""`agentrl train`: the GRPO trainer (also: ``torchrun --nproc-per-node N -m trainer ...``).

    agentrl train --gateway http://127.0.0.1:8000 --admin-key K --model smollm2 [--config trainer.yaml]

Every setting of :class:`trainer.config.TrainerSettings` is a flag, an ``AGENTRL_TRAINER_*`` variable or a
key of the YAML file; bad combinations are refused before the model is loaded.
"""

from __future__ import annotations

import argparse
import logging
import sys

from agentrl.settings import SettingsError, add_arguments, load


def register(sub: argparse._SubParsersAction) -> None:
    from trainer.config import TrainerSettings

    parser = sub.add_parser("train", help="the GRPO trainer (also: torchrun -m trainer)",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, TrainerSettings)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from trainer.config import TrainerSettings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        settings = load(TrainerSettings, args)
    except SettingsError as exc:
        print(f"agentrl train: {exc}", file=sys.stderr)
        return 2
    from trainer.loop import train
    from trainer.weight_sync import WeightSyncError
    from trainer.data import GatewayError

    import torch.distributed as dist

    from trainer.model import close_distributed

    finished = False
    try:
        state = train(settings)
        if dist.get_rank() == 0:
            print(f"agentrl train: done at step {state.step}, weight version {state.version}", file=sys.stderr)
        finished = True
    except (SettingsError, WeightSyncError, GatewayError) as exc:
        print(f"agentrl train: {exc}", file=sys.stderr)
        return 1
    finally:
        close_distributed(finished=finished)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from trainer.config import TrainerSettings

    add_arguments(parser, TrainerSettings)
    return run(parser.parse_args(argv))
