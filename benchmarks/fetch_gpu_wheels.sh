#!/usr/bin/env bash
# Wheels the GPU image lacks, downloaded here into .whl/ (git-ignored through .git/info/exclude) so that a
# device call can carry them: graphviz-pure, which export's graph.svg needs (tests/test_export.py).
#
#   bash benchmarks/fetch_gpu_wheels.sh
#   # then, in a device call that carries .whl, start the command with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-path info/exclude)"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
# The GPU image runs Python 3.12 on x86_64 Linux; graphviz-pure is one binary wheel, no dependencies.
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "graphviz-pure==$(python3 -m pip show graphviz-pure 2>/dev/null | sed -n 's/^Version: //p' || echo 0.2.2)"
ls -la .whl
