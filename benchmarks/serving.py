"""The serving benchmark, now `freetoken.bench.serving` (`ft bench serve`); this path keeps the
documented command `python benchmarks/serving.py ...` and peer.py's import working."""

import sys

from freetoken.bench import serving as _serving

if __name__ == "__main__":
    _serving.main(sys.argv[1:])
else:  # imported (by path, as peer.py does): be the package's module itself
    sys.modules[__name__] = _serving
