#!/usr/bin/env bash
# Fresh-clone check: what a newcomer does first, timed step by step.
#
#   scripts/fresh_clone_check.sh [--ref REF] [--dir DIR] [--main-job] [--tests] [--keep] [--dry-run]
#
# Clones this repository (its committed REF, default HEAD) into a temporary folder, then runs the
# README's setup block (marked <!-- block: setup -->) as written there: its first line (the install), its second (the main
# job) with --help unless --main-job is given, then `layersplit plan --model glm-5 --cp 8 --hardware h200`
# and the same plan from a model's own config.json. --tests also runs the README's test command (long:
# the whole suite). Prints each step's wall time; a failing step prints its log's tail and stops.
# --dry-run prints the commands read from this checkout's README and runs nothing.
set -euo pipefail

ref=HEAD dir="" main_job=0 tests=0 keep=0 dry_run=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --ref) ref="$2"; shift 2 ;;
        --dir) dir="$2"; shift 2 ;;
        --main-job) main_job=1; shift ;;
        --tests) tests=1; shift ;;
        --keep) keep=1; shift ;;
        --dry-run) dry_run=1; shift ;;
        -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "fresh_clone_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done

repo="$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)"
work="${dir:-$(mktemp -d "${TMPDIR:-/tmp}/layersplit-fresh.XXXXXX")}"
mkdir -p "$work"
[[ $keep -eq 1 || -n "$dir" ]] || trap 'rm -rf "$work"' EXIT
clone="$work/layersplit"
logs="$work/logs"
mkdir -p "$logs"
declare -a names=() times=()

step() {  # step NAME COMMAND...: run in the clone, log to $logs/NAME.log, record the wall time
    local name="$1"; shift
    local start end
    start=$(date +%s.%N)
    if ! (cd "${cwd:-$clone}" && "$@") >"$logs/$name.log" 2>&1; then
        echo "fresh_clone_check: step '$name' failed; last lines of $logs/$name.log:" >&2
        tail -n 20 "$logs/$name.log" >&2
        exit 1
    fi
    end=$(date +%s.%N)
    names+=("$name")
    times+=("$(python3 -c "print(f'{$end - $start:.1f}')")")
    printf '%-28s %8s s\n' "$name" "${times[-1]}"
}

readme_block() {  # the README's block marked <!-- block: $1 --> in README $2, one command per line
    awk -v mark="<!-- block: $1 -->" '
        $0 == mark { found = 1; next }
        found && /^```/ && !inside { inside = 1; next }
        inside && /^```/ { exit }
        inside && NF { print }' "$2"
}

if [[ $dry_run -eq 1 ]]; then
    readme_block setup "$repo/README.md" | sed -n '1s/^/install: /p; 2s/^/main job: /p'
    readme_block tests "$repo/README.md" | sed -n '1s/^/tests: /p'
    exit 0
fi

echo "fresh_clone_check: $repo @ $ref -> $clone"
cwd="$work" step clone git clone --quiet --no-hardlinks "$repo" "$clone"
step checkout git -c advice.detachedHead=false checkout --quiet "$ref"
mapfile -t setup < <(readme_block setup "$clone/README.md")
mapfile -t testcmd < <(readme_block tests "$clone/README.md")
[[ ${#setup[@]} -ge 2 && ${#testcmd[@]} -ge 1 ]] || { echo "fresh_clone_check: README blocks not found" >&2; exit 1; }
echo "install:  ${setup[0]}"
echo "main job: ${setup[1]}"
step install bash -c "${setup[0]}"
if [[ $main_job -eq 1 ]]; then
    step main-job bash -c "${setup[1]}"
else
    step main-job-help bash -c "${setup[1]} --help"
fi
step plan .venv/bin/layersplit plan --model glm-5 --cp 8 --hardware h200
step plan-config-json .venv/bin/layersplit plan --model tests/layersplit/plan/model_configs/GLM-5 --cp 8 --hardware h200
if [[ $tests -eq 1 ]]; then
    step tests bash -c "${testcmd[0]}"
fi

echo
echo "fresh_clone_check: all steps passed (logs: $logs$([[ $keep -eq 1 || -n "$dir" ]] || echo ', removed on exit'))"
for i in "${!names[@]}"; do printf '  %-26s %8s s\n' "${names[$i]}" "${times[$i]}"; done
