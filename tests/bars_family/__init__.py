"""The proof that a family is one folder: "bars", a small text-to-video family defined in tests/, with its own
model (model.py), its own VAE-like encoder and text encoder (encoders.py), its own dataset (data.py) and option
(--text_width), and its family module (family.py). Importing this package registers it
(OPENDIT_FAMILIES=tests.bars_family makes the entry scripts know it); train.py, sample.py, preprocess.py and
opendit/ run it unchanged, with sequence parallelism and LoRA (tests/test_bars_family.py)."""
from opendit.families import register_family
from tests.bars_family.family import BarsFamily

register_family(BarsFamily())
