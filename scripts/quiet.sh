# Sourced by gpu_call.sh and gpu_campaign.sh: quiet filters progress-bar redraws out of a log.
# tqdm redraws with \r: split there first, so a line it writes between redraws survives.
quiet() { sed -u "s/\r/\n/g" | grep --line-buffered -v -E "it/s|s/it|step/s|s/step|file/s|run/s|s/run"; }
