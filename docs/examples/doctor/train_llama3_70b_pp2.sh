#!/bin/bash
# Llama 3 70B on 8 DGX H100 nodes (64 GPUs): TP 8, PP 2, DP 4, without the distributed optimizer.
GPUS_PER_NODE=8
NUM_NODES=8

TP_SIZE=8
PP_SIZE=2
MICRO_BATCH_SIZE=1
GLOBAL_BATCH_SIZE=128

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
)

MODEL_ARGS=(
    --num-layers 80
    --hidden-size 8192
    --ffn-hidden-size 28672
    --num-attention-heads 64
    --group-query-attention
    --num-query-groups 8
    --seq-length 8192
    --max-position-embeddings 8192
    --swiglu
    --untie-embeddings-and-output-weights
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP_SIZE
    --pipeline-model-parallel-size $PP_SIZE
    --sequence-parallel
)

TRAINING_ARGS=(
    --micro-batch-size $MICRO_BATCH_SIZE
    --global-batch-size $GLOBAL_BATCH_SIZE
    --bf16
    --lr 1.5e-4
)

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${MODEL_ARGS[@]} ${PARALLEL_ARGS[@]} ${TRAINING_ARGS[@]}
