#!/bin/bash
# Llama-3 8B in FP8 on one 8-GPU H100 node (TP 1, PP 1, d = 8, distributed optimizer), with the
# settings of NVIDIA's Megatron-LM example examples/llama/train_llama3_8b_h100_fp8.sh
# (github.com/NVIDIA/Megatron-LM, commit 157006d6d9bf4f55c0d4d7dacbd2b65e7bd84dc9; Megatron-LM's
# LICENSE), written here in the same shell style (bash arrays, the FP8 flags quoted in pairs and
# expanded unquoted) rather than copied: model shape, batch, --bf16 --grad-reduce-in-bf16,
# --fp8-format hybrid, --fp8-amax-history-len 1024, --fp8-amax-compute-algo max, --fp8-param-gather.

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

CHECKPOINT_PATH=${1:-"checkpoints/llama3_8b_fp8"}
TOKENIZER_ARG=${3:-"MOCK"}

GPUS_PER_NODE=8
NUM_NODES=1
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NODE_RANK=${NODE_RANK:-0}

TP_SIZE=1
CP_SIZE=1
MICRO_BATCH_SIZE=1
GLOBAL_BATCH_SIZE=128
NUM_LAYERS=32
DTYPE="fp8"
SEQ_LENGTH=8192

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

MODEL_ARGS=(
    --use-mcore-models
    --num-layers $NUM_LAYERS
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128
    --seq-length $SEQ_LENGTH
    --max-position-embeddings $SEQ_LENGTH
    --position-embedding-type rope
    --rotary-base 1000000
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --swiglu
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)

TRAINING_ARGS=(
    --micro-batch-size $MICRO_BATCH_SIZE
    --global-batch-size $GLOBAL_BATCH_SIZE
    --lr 0.00015
    --clip-grad 1.0
    --bf16
    --grad-reduce-in-bf16
    --cross-entropy-loss-fusion
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

DTYPE_ARGS=()
if [[ "$DTYPE" == "fp8" ]]; then
    DTYPE_ARGS+=(
        "--fp8-format hybrid"
        "--fp8-amax-history-len 1024"
        "--fp8-amax-compute-algo max"
        "--fp8-param-gather"
    )
fi

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP_SIZE
    --context-parallel-size $CP_SIZE
    --sequence-parallel
)

DATA_ARGS=(
    --mock-data
    --tokenizer-type NullTokenizer
    --vocab-size 128256
)

torchrun ${DISTRIBUTED_ARGS[@]} \
    examples/classes/pretrain_gpt.py \
    ${MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${DTYPE_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    --save "$CHECKPOINT_PATH"
