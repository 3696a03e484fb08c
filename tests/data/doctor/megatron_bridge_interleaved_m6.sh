#!/bin/bash
# Interleaved schedule at p = 4, v = 2 with 6 micro-batches: megatron-core's interleaved
# schedule raises "The remainder of M ... should be 0, or larger than or equal to the
# pipeline-parallel size" at the first step (Megatron-Bridge issues 5884, 5893).
PP=4
VP=2
MBS=1
GBS=6
torchrun --nproc_per_node 4 pretrain_gpt.py \
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 8192 \
    --max-position-embeddings 8192 --swiglu --untie-embeddings-and-output-weights \
    --pipeline-model-parallel-size $PP --num-virtual-stages-per-pipeline-rank $VP \
    --micro-batch-size $MBS --global-batch-size $GBS --bf16
