"""DatasetSpec: one --dataset value, as a model family offers it.

Each dataset module defines the spec of its data (its name, a help line, how to build it, what --data_path
must point at); a model family lists the specs it trains on (its `datasets`), so `--dataset` names, help and
path checks come from one place and no shared code keeps a list of datasets.
"""
from collections.abc import Callable
from dataclasses import dataclass

from torch.utils.data import Dataset

from opendit.data.transforms import check_image_size


@dataclass(frozen=True)
class DatasetSpec:
    """name: the --dataset value. help: one line for --help and the docs. build(data_path, image_size,
    **options) -> the dataset (options: what its class takes, e.g. channels, seed, random_flip; the family
    decides them). path: what --data_path must name ("": built in, no path, e.g. the demo data); demo: the
    built-in dataset of the same kind, named when the path is missing. cache: a latent cache written by
    preprocess.py (its image size comes from the cache; not a source to encode). channels: the data's own (1 for
    the grey digits), what a pixel-space model sees. settings: names of the run's options its build takes as
    keyword arguments as they are (e.g. caption_extension). pattern: the path may be a pattern or a URL (sharded
    streams), which the dataset checks itself when built, rather than a file that must exist. probe(data_path, cfg)
    -> the data's own channels where they vary with the data (a stream's first image: 1 for grey, else 3). pairs:
    editing pairs, items (target, controls [K, C, H, W], instruction), for a model that takes reference images."""
    name: str
    help: str
    build: Callable[..., Dataset]
    path: str = ""
    demo: str = ""
    cache: bool = False
    channels: int = 3
    settings: tuple[str, ...] = ()
    pattern: bool = False
    probe: Callable[..., int] | None = None
    pairs: bool = False

    def data_channels(self, data_path, cfg) -> int:
        """The channels a pixel-space model sees of this data: probed where the spec can, else `channels`."""
        return self.probe(data_path, cfg) if self.probe is not None and data_path else self.channels

    @property
    def built_in(self) -> bool:
        return not self.path

    def __call__(self, data_path=None, image_size=None, **options) -> Dataset:
        if self.path and data_path is None:
            instead = f" or use --dataset {self.demo} for the built-in demo" if self.demo else ""
            raise ValueError(f"dataset {self.name!r} needs a data path; pass --data_path <{self.path}>{instead}")
        if not self.cache:
            image_size = check_image_size(image_size)
        return self.build(data_path, image_size, **options)


def dataset_map(*specs: DatasetSpec) -> dict[str, DatasetSpec]:
    """{name: spec} of a family's datasets, in the order given."""
    return {spec.name: spec for spec in specs}
