#!/bin/bash
# GPT-3 175B on 128 GPUs (16 nodes x 8), the way Megatron-LM's examples/gpt3 script sets it up.

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=8
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=6000
NUM_NODES=16
NODE_RANK=${NODE_RANK:-0}
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))

CHECKPOINT_PATH=$1 # checkpoints
DATA_PATH=$5 # prefix_text_document

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

GPT_MODEL_ARGS=(
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length 2048
    --max-position-embeddings 2048
    --attention-backend auto # flash/fused/unfused/local
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1536
    --train-iters 500000
    --weight-decay 0.1
    --clip-grad 1.0
    --fp16
    --lr 6.0e-5
    --lr-decay-style cosine
)

MODEL_PARALLEL_ARGS=(
	--tensor-model-parallel-size 8
	--pipeline-model-parallel-size 16
)

DATA_ARGS=(
    --data-path $DATA_PATH
    --split 949,50,1
)

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${GPT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH
