#!/bin/bash
# A Llama-shaped 32-layer model on 4 GPUs, pipeline only, interleaved with 3 layers per virtual stage.
GPUS_PER_NODE=4
NUM_NODES=1

PP_SIZE=4
MICRO_BATCH_SIZE=1
GLOBAL_BATCH_SIZE=16

MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --num-attention-heads 32
    --seq-length 4096
    --max-position-embeddings 4096
    --swiglu
    --untie-embeddings-and-output-weights
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size $PP_SIZE
    --num-layers-per-virtual-pipeline-stage 3
)

TRAINING_ARGS=(
    --micro-batch-size $MICRO_BATCH_SIZE
    --global-batch-size $GLOBAL_BATCH_SIZE
    --bf16
    --lr 3e-4
)

torchrun --nproc_per_node $GPUS_PER_NODE --nnodes $NUM_NODES pretrain_gpt.py \
    ${MODEL_ARGS[@]} ${PARALLEL_ARGS[@]} ${TRAINING_ARGS[@]}
