#!/usr/bin/env bash
# What a lent GPU machine lacks for benchmarks/device_session.sh, built here, before its one
# device call, into two folders of this checkout that git ignores:
#   .whl/     the wheels of the Hydra stack (hydra-core, omegaconf, antlr4-python3-runtime) at the
#             versions installed here, for the machine's Python (3.12, x86-64: device README);
#   .netbin/  `ip` and `tc` (netbench's network namespaces and shaping), with the libraries `ldd`
#             names except the C library's own, each wrapped to run through the machine's loader
#             with those libraries only (`ip netns exec` children do not inherit them).
# Then the device call carries both (device_session.sh's header has the command).
#
#     bash benchmarks/prepare_device.sh [PYTHON_VERSION]      (default 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
python_version=${1:-3.12}
PY=${PYTHON:-python3}

rm -rf .whl .netbin
mkdir -p .whl .netbin/lib

installed() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }

for package in hydra-core omegaconf; do
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "$package==$(installed "$package")"
done
# antlr4's Python runtime ships as source only; it is pure Python, so a wheel built here fits any machine
"$PY" -m pip wheel --quiet --no-deps -w .whl "antlr4-python3-runtime==$(installed antlr4-python3-runtime)"

for tool in ip tc; do
    binary=$(command -v "$tool")
    cp "$binary" ".netbin/$tool.bin"
    ldd "$binary" | awk '$3 ~ /^\// {print $3}' | while read -r library; do
        case "$(basename "$library")" in
            libc.so.* | libm.so.* | ld-linux*) ;;  # the machine's own, matched to its loader
            *) cp -L "$library" .netbin/lib/ ;;
        esac
    done
    cat >".netbin/$tool" <<EOF
#!/bin/sh
here=\$(cd "\$(dirname "\$0")" && pwd)
exec /lib64/ld-linux-x86-64.so.2 --library-path "\$here/lib" "\$here/$tool.bin" "\$@"
EOF
    chmod +x ".netbin/$tool"
done

.netbin/ip -V >/dev/null && .netbin/tc -V >/dev/null
echo "prepare_device.sh: $(ls .whl | wc -l) wheels in .whl ($(du -sh .whl | cut -f1)), ip and tc in .netbin ($(du -sh .netbin | cut -f1))"
