"""Print the project's runtime dependencies (pyproject.toml), one per line, for the image's
dependency layer: installed before the code is copied, so a code change rebuilds one small
layer instead of every dependency."""

import sys
import tomllib

with open(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml", "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
print("\n".join(d for d in deps if not d.startswith("torch")))
