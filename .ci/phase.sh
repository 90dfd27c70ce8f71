# `phase NAME COMMAND...`: run COMMAND between two lines naming it, the second with its time. Sourced by
# the scripts in this folder.
phase() {
    local name=$1
    shift
    local start=$SECONDS
    echo "=== ${name}: $*"
    "$@"
    echo "=== ${name}: done in $((SECONDS - start)) s"
}
