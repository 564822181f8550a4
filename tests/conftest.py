import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))          # test helpers: models, dist_utils, simulate
sys.path.insert(0, str(HERE.parent))   # examples/

warnings.filterwarnings("ignore", category=FutureWarning)
