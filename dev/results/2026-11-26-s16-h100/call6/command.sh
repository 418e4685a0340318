export PYTHONPATH=/tmp/site; python3 .anchors/qlora_big.py --run /tmp/q7 --out $OUT/q --deadline 150 --case-timeout 100 --cases nanotune:on+offload:2x2048,unsloth:on:2x2048
