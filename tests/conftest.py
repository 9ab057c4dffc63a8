import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURES = ROOT / "fixtures"

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")


def load_rank_file(path):
    """A legacy rank file read by torch itself (weights_only), with the args Namespace allowed.
    The (object, name) form matters: a plain entry is removed from torch's allow-list on exit,
    which would also drop megatron-core's own registration of argparse.Namespace (made when
    megatron.core is imported) and make its later loads in this process fail."""
    import argparse

    import torch

    with torch.serialization.safe_globals([(argparse.Namespace, "argparse.Namespace")]):
        return torch.load(path, weights_only=True)
