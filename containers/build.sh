#!/usr/bin/env bash
# Build or test the project's Apptainer images.
#
#   containers/build.sh IMAGE           build containers/IMAGE.sif from containers/IMAGE.def
#   containers/build.sh --test IMAGE    run the %test section of containers/IMAGE.sif
#
# IMAGE is "pinned" (NGC 24.02 + transformers 4.38.2 / DeepSpeed 0.13.2) or
# "current" (NGC 25.12, PyPI torch 2.13.0, vLLM + containers/requirements-current.txt).
# The script can be called from anywhere; it works from the repository root,
# because the .def files' %files paths are relative to it.
#
# Environment:
#   APPTAINER_BUILD_ARGS  extra arguments for `apptainer build`; the default is
#                         --fakeroot (dropped when running as root)
#   APPTAINER_TMPDIR, APPTAINER_CACHEDIR
#                         where apptainer unpacks and caches layers; the NGC
#                         bases are ~10-20 GB, so point these at a big disk
set -euo pipefail

usage() {
    sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

mode="build"
case "${1:-}" in
    --test) mode="test"; shift ;;
    -h|--help) usage; exit 0 ;;
esac
if [ $# -ne 1 ]; then
    usage >&2
    exit 2
fi
image=$1
case "$image" in
    pinned|current) ;;
    *) echo "build.sh: unknown IMAGE '$image' (expected: pinned or current)" >&2; exit 2 ;;
esac

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
def="containers/$image.def"
sif="containers/$image.sif"

runtime=""
for candidate in apptainer singularity; do
    if command -v "$candidate" >/dev/null 2>&1; then
        runtime=$candidate
        break
    fi
done

if [ -z "$runtime" ]; then
    if [ "$mode" = test ]; then
        cmd="apptainer test --nv $sif    # drop --nv where no GPU is visible"
        again="containers/build.sh --test $image"
    else
        cmd="apptainer build --fakeroot $sif $def"
        again="containers/build.sh $image"
    fi
    cat >&2 <<EOF
build.sh: neither 'apptainer' nor 'singularity' is installed on this machine.
On a machine that has Apptainer (>= 1.1), run from the repository root:

    $cmd

or run this script there: $again
EOF
    exit 1
fi

cd "$repo_root"

if [ "$mode" = test ]; then
    if [ ! -f "$sif" ]; then
        echo "build.sh: $sif does not exist; build it first: containers/build.sh $image" >&2
        exit 1
    fi
    nv=()
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        nv=(--nv)   # GPU visible: also run the flash-attn CUDA smoke test
    else
        echo "build.sh: no GPU visible; the flash-attn CUDA smoke test will be skipped" >&2
    fi
    set -x
    exec "$runtime" test ${nv[@]+"${nv[@]}"} "$sif"
fi

# Build. Every path in %files has to exist, or the build fails late.
requirements="containers/requirements-$image.txt"
missing=()
for path in pyproject.toml core pipeline schedulers stages "$requirements" "$def"; do
    [ -e "$path" ] || missing+=("$path")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "build.sh: missing in $repo_root: ${missing[*]}" >&2
    exit 1
fi

if [ -n "${APPTAINER_BUILD_ARGS+set}" ]; then
    # shellcheck disable=SC2206  # word splitting wanted
    build_args=($APPTAINER_BUILD_ARGS)
elif [ "$(id -u)" -eq 0 ]; then
    build_args=()
else
    build_args=(--fakeroot)
fi

# Build into a temporary name so a failed build keeps the previous image.
partial="$sif.partial"
rm -f "$partial"
set -x
"$runtime" build ${build_args[@]+"${build_args[@]}"} "$partial" "$def"
mv -f "$partial" "$sif"
{ set +x; } 2>/dev/null
echo "built $sif; test it with: containers/build.sh --test $image"
