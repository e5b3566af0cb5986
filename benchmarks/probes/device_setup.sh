# Sourced by the device probes, from the repository root: installs the carried wheels (.whl: the
# packages the GPU image lacks, such as llguidance and fastapi) into /tmp/site and puts that and the
# checkout on PYTHONPATH.   . benchmarks/probes/device_setup.sh
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
