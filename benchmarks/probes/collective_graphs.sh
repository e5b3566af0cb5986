#!/usr/bin/env bash
# The collective_graphs.py variants measured on 2 GPUs (tensor 2) and one (llama-8b and llama-1b shapes).
#   OUT=DIR benchmarks/probes/collective_graphs.sh
set -u
C1="--xla_gpu_enable_command_buffer=+COLLECTIVES --xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false"
V2=$(cat <<J
[{"name":"defaults","xla_flags":""},
 {"name":"nccl_no_graph","xla_flags":"--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false"},
 {"name":"coll","xla_flags":"$C1"},
 {"name":"coll_empty_kernels","xla_flags":"--xla_gpu_enable_command_buffer=+COLLECTIVES --xla_gpu_experimental_use_collective_kernels="},
 {"name":"coll_sync","xla_flags":"$C1 --xla_gpu_disable_async_collectives=ALLREDUCE"},
 {"name":"coll_skip_temp","xla_flags":"$C1 --xla_gpu_command_buffer_update_mode=SKIP_TEMP"},
 {"name":"coll_sync_skip_temp","xla_flags":"$C1 --xla_gpu_disable_async_collectives=ALLREDUCE --xla_gpu_command_buffer_update_mode=SKIP_TEMP"},
 {"name":"coll_skip_profiled","xla_flags":"$C1 --xla_gpu_command_buffer_update_mode=SKIP_PROFILED"},
 {"name":"coll_skip_temp_symmetric","xla_flags":"$C1 --xla_gpu_command_buffer_update_mode=SKIP_TEMP --xla_gpu_experimental_enable_nccl_symmetric_buffers=true","env":{"XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB":"64"}}]
J
)
V1='[{"name":"defaults","xla_flags":""},{"name":"skip_temp","xla_flags":"--xla_gpu_command_buffer_update_mode=SKIP_TEMP"},{"name":"skip_profiled","xla_flags":"--xla_gpu_command_buffer_update_mode=SKIP_PROFILED"}]'
nvidia-smi -L
export PROBE_VARIANT_TIMEOUT=150
python benchmarks/probes/collective_graphs.py --tp 2 --out $OUT/cg --variants "$V2" 2>&1 | grep -v "^W\|^I" | tail -20
python benchmarks/probes/collective_graphs.py --tp 1 --out $OUT/cg --variants "$V1" 2>&1 | tail -5
python benchmarks/probes/collective_graphs.py --tp 1 --layers 16 --hidden 2048 --qkv 3072 --ffn 8192 --out $OUT/cg --variants "$V1" 2>&1 | tail -5
du -sh $OUT
