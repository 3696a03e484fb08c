#!/bin/bash
# Megatron-LM issue 468: 80 layers, pipeline 16, 2 layers per virtual stage.
# Versions without the divisibility checks trained 64 layers; current ones refuse to start.
GPUS_PER_NODE=8
NNODES=16
DISTRIBUTED_ARGS="--nproc_per_node $GPUS_PER_NODE --nnodes $NNODES --node_rank 0 --master_addr localhost --master_port 6000"

python -m torch.distributed.launch $DISTRIBUTED_ARGS \
       pretrain_gpt.py \
       --tensor-model-parallel-size 8 \
       --pipeline-model-parallel-size 16 \
       --num-layers-per-virtual-pipeline-stage 2 \
       --num-layers 80 \
       --hidden-size 8192 \
       --num-attention-heads 64 \
       --micro-batch-size 1 \
       --global-batch-size 64 \
       --seq-length 2048 \
       --max-position-embeddings 2048 \
       --train-iters 500000 \
       --lr 0.00015 \
       --fp16
