import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURES = ROOT / "fixtures"

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
