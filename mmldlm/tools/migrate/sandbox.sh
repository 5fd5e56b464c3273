# The shell an older launcher runs in under `mmldlm migrate` (shell.py starts it): real bash, with
# every command that reaches outside this shell recorded instead of run. Sourced before the launcher
# (and before any bash script the launcher starts), with these set by shell.py:
#   __MIG_DIR   the scratch folder: records go to rec/, redirected output to out/
#   __MIG_BIN   the only folder on PATH: pure tools (bc, sed, grep, ...) and their guards
#   __MIG_NGPUS __MIG_GPU_MIB __MIG_GPU_NAME __MIG_CPUS   the cluster's facts, as its tools report them
#
# What runs: shell builtins and keywords, the launcher's own functions, and the tools in __MIG_BIN.
# What is recorded, not run (one file per call in rec/, read by shell.py):
#   - a command found nowhere (command_not_found_handle): torchrun, python, mkdir, rm, sleep, ...;
#   - a command named by a path or a variable (/opt/conda/bin/torchrun, $PY, ./run.sh), caught by
#     the DEBUG trap below before bash runs it;
#   - exec of a command (the launcher ends there, as exec would end it), kill, trap, enable, hash.
# Answered with the cluster's facts: nvidia-smi, nproc, getconf, which, command -v.
# Shadowed by functions: cd/pushd/popd/pwd (a folder missing here is followed by name), source/.
# (a file missing here is named and skipped), [ / test (a file test of a path missing here answers
# "exists", as on the cluster), read (-p or from the terminal: named and answered with Enter).
# Output redirected to a file (> f, >> f, &> f, exec > f) goes to out/ instead; noclobber keeps a
# redirection this trap does not see (on a { } group or a loop) from truncating a file. Input from
# the terminal (< /dev/tty) reads /dev/null: migrate never reads the user's terminal. The launcher's
# `set -x` trace (and this file's with it) goes to out/xtrace, so that its output is its own.

shopt -s extdebug   # the DEBUG trap can skip a command; functions and subshells inherit it
set -o noclobber
export __MIG_WHERE  # where the command now running is, for the tools of __MIG_BIN that record
__MIG_STEPS=0
__MIG_OUT=0
__MIG_TTY=""  # set while the command now running had its input from /dev/tty
exec {__MIG_XFD}>>"$__MIG_DIR/out/xtrace"
BASH_XTRACEFD=$__MIG_XFD
declare -A __MIG_RECORDED=() # where -> how many commands it sent to a recorder
declare -A __MIG_FACTS=([nvidia-smi]=1 [nproc]=1 [getconf]=1 [which]=1 [tee]=1 [env]=1 [hostname]=1)

# One record: KIND, where (file:line), the folder it ran in, the number of its words, its words and,
# for a command, the exported variables. NUL-separated, one file per record.
__mig_record() {
    local __mig_kind=$1 __mig_f
    shift
    __mig_f="$__MIG_DIR/rec/${EPOCHREALTIME/[.,]/}-$BASHPID-$RANDOM"
    {
        printf '%s\0' "$__mig_kind" "${__MIG_WHERE:-?}" "$PWD" "$#" "$@"
        if [[ $__mig_kind == cmd ]]; then
            local __mig_n
            for __mig_n in $(compgen -e); do printf '%s\0' "$__mig_n=${!__mig_n}"; done
        fi
    } >"$__mig_f"
}

command_not_found_handle() {
    __mig_record cmd "$@"
    return 0
}

# A command given by its words (after bash expanded them): leading NAME=value words are its
# environment; then our shadow or fact function, a builtin, the launcher's function, a pure tool of
# __MIG_BIN (by its base name, wherever the launcher found it), or a record.
__mig_dispatch() {
    local -a __mig_env=()
    while (($#)) && [[ $1 =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do
        __mig_env+=("$1")
        shift
    done
    ((${#__mig_env[@]})) && local -x "${__mig_env[@]}"
    (($#)) || return 0
    local __mig_base=${1##*/}
    if [[ $1 != */* ]] && [[ $(type -t -- "$1") == @(function|builtin|keyword) ]]; then
        "$@"
    elif [[ -n ${__MIG_FACTS[$__mig_base]:-} ]]; then
        "$__mig_base" "${@:2}"
    elif [[ -x $__MIG_BIN/$__mig_base ]]; then
        "$__MIG_BIN/$__mig_base" "${@:2}"
    else
        __mig_record cmd "$@"
    fi
}

# The words of a command without running it: bash expands them in __mig_words' arguments.
__mig_words() { __MIG_WORDS=("$@"); }

# The top-level words of BASH_COMMAND's first line (the rest is a here-document's body), as bash
# would split them before expanding: quotes, $(...), ${...}, `...` and <(...) stay inside a word, and
# each redirection operator (with its fd: 2>, &>, >&1) is a word of its own. Sets __MIG_TOKENS and,
# for each, __MIG_KINDS: w (a word) or r (a redirection operator).
__mig_split() {
    local __line=${1%%$'\n'*} __i=0 __n __c __q="" __depth=0 __word="" __op
    __MIG_TOKENS=()
    __MIG_KINDS=()
    __n=${#__line}
    while ((__i < __n)); do
        __c=${__line:__i:1}
        if [[ -n $__q ]]; then # inside '...', "..." or `...`
            __word+=$__c
            if [[ $__c == "$__q" ]]; then
                __q=""
            elif [[ $__q != "'" && $__c == '\' ]]; then
                __word+=${__line:__i+1:1}
                ((__i++))
            fi
        elif ((__depth)); then # inside $( ), ${ }, <( ) or >( )
            __word+=$__c
            case $__c in
            '(' | '{') ((__depth++)) ;;
            ')' | '}') ((__depth--)) ;;
            "'" | '"' | '`') __q=$__c ;;
            '\') __word+=${__line:__i+1:1}; ((__i++)) ;;
            esac
        else
            case $__c in
            [[:space:]])
                [[ -n $__word ]] && { __MIG_TOKENS+=("$__word"); __MIG_KINDS+=(w); __word=""; } ;;
            "'" | '"' | '`') __word+=$__c; __q=$__c ;;
            '\') __word+=$__c${__line:__i+1:1}; ((__i++)) ;;
            '$')
                __word+=$__c
                [[ ${__line:__i+1:1} == [\(\{] ]] && { __word+=${__line:__i+1:1}; ((__i++, __depth = 1)); } ;;
            '<' | '>' | '&')
                if [[ ${__line:__i+1:1} == '(' && $__c != '&' ]]; then
                    __word+=$__c'('; ((__i++, __depth = 1))
                elif [[ $__c == '&' && ${__line:__i+1:1} != '>' ]]; then
                    __word+=$__c
                else
                    [[ -n $__word && ! $__word =~ ^[0-9]+$ ]] && { __MIG_TOKENS+=("$__word"); __MIG_KINDS+=(w); __word=""; }
                    __op=$__word
                    __word=""
                    while [[ ${__line:__i:1} == [\<\>\&\|] ]]; do __op+=${__line:__i:1}; ((__i++)); done
                    [[ $__op == *'&' && ${__line:__i:1} == [0-9-] ]] && { __op+=${__line:__i:1}; ((__i++)); }
                    __MIG_TOKENS+=("$__op")
                    __MIG_KINDS+=(r)
                    continue
                fi
                ;;
            *) __word+=$__c ;;
            esac
        fi
        ((__i++))
    done
    [[ -n $__word ]] && { __MIG_TOKENS+=("$__word"); __MIG_KINDS+=(w); }
    return 0
}

# A redirection's file of out/, its target recorded as bash expanded it.
__mig_sink() {
    __mig_record redirect "$2"
    printf '%s' "$__MIG_DIR/out/$1"
}

# __MIG_TOKENS with the target of each output redirection to a file (not /dev/null, /dev/std*,
# /dev/fd/N) replaced by a new file of out/, the original recorded, and input from /dev/tty by
# /dev/null; sets __MIG_TEXT (the command again, with the rest of a here-document) and returns 0
# when something was replaced.
__mig_redirect() {
    local __k __t __changed=1
    for ((__k = 0; __k < ${#__MIG_TOKENS[@]}; __k++)); do
        [[ ${__MIG_KINDS[__k]} == r ]] || continue
        __t=${__MIG_TOKENS[__k + 1]:-}
        if [[ ${__MIG_TOKENS[__k]} == *'<'* && $__t == /dev/tty ]]; then
            __mig_record tty "${__MIG_TOKENS[__k]} $__t"
            __MIG_TOKENS[__k + 1]=/dev/null
            __MIG_TTY=1
            __changed=0
            continue
        fi
        [[ ${__MIG_TOKENS[__k]} == *[\>]* && ${__MIG_TOKENS[__k]} != *'&'[0-9-] ]] || continue
        [[ -z $__t || $__t == /dev/null || $__t == /dev/std* || $__t == /dev/fd/* || $__t == '>('* ]] && continue
        ((++__MIG_OUT))
        __MIG_TOKENS[__k + 1]="\"\$(__mig_sink $__MIG_OUT $__t)\""
        __changed=0
    done
    __MIG_TEXT="${__MIG_TOKENS[*]}"
    [[ $1 == *$'\n'* ]] && __MIG_TEXT+=$'\n'${1#*$'\n'}
    return $__changed
}

# The DEBUG trap: 0 lets bash run BASH_COMMAND itself; 1 hands it to the trap's eval of __MIG_EVAL,
# which runs in the launcher's own context ("$@", its locals), after which bash skips the command.
__mig_debug() {
    # this file's own commands, and shell.py's START line
    [[ ${BASH_SOURCE[1]:-} == "$__MIG_PRELUDE" || -z ${BASH_SOURCE[1]:-} ]] && return 0
    local __cmd=$BASH_COMMAND __first __rest __changed=1
    __MIG_WHERE="${BASH_SOURCE[1]:-$0}:${BASH_LINENO[0]:-0}"
    __MIG_TTY=""
    if ((++__MIG_STEPS > 5000)); then
        __mig_record stop "more than 5000 commands"
        exit 125
    fi
    if [[ $__cmd == '[['* || $__cmd == '(('* ]]; then
        __mig_file_tests "$__cmd"
        return 0
    fi
    __mig_split "$__cmd"
    local __k=0
    while [[ ${__MIG_KINDS[__k]:-} == w && ${__MIG_TOKENS[__k]} =~ ^[A-Za-z_][A-Za-z0-9_]*(\[[^]]*\])?\+?= ]]; do
        ((__k++))
    done
    __first=${__MIG_TOKENS[__k]:-}
    [[ ${__MIG_KINDS[__k]:-} == w ]] || __first=""
    if __mig_redirect "$__cmd"; then
        __cmd=$__MIG_TEXT
        __changed=0
    fi
    __rest="${__MIG_TOKENS[*]:__k}"
    local __words="" __j # the command's words after its name, without its redirections
    for ((__j = __k + 1; __j < ${#__MIG_TOKENS[@]}; __j++)); do
        [[ ${__MIG_KINDS[__j]} == w && ${__MIG_KINDS[__j - 1]} == w ]] && __words+=" ${__MIG_TOKENS[__j]}"
    done
    [[ -z $__first ]] && { ((__changed)) && return 0; __MIG_EVAL=$__cmd; return 1; }
    # A line that reaches a recorder again and again is a loop around a command that never fails here
    # (a restart loop around torchrun): 25 times are enough to read it.
    if [[ $__first != [\[\(]* ]] && ! [[ -n $__first && $__first =~ ^[][A-Za-z0-9_.:@%,+-]+$ && -n $(type -t -- "$__first") ]]; then
        if ((++__MIG_RECORDED[$__MIG_WHERE] > 25)); then
            __mig_record stop "$__MIG_WHERE ran 25 times"
            exit 125
        fi
    fi
    case $__first in
    exec)
        __MIG_EXEC_TEXT=$__cmd
        __MIG_EVAL="__mig_words $__words; __mig_exec"
        ;;
    kill | trap | enable | hash | disown | coproc | ulimit | suspend | logout)
        __MIG_EVAL="__mig_words $__words; __mig_record skipped $__first \"\${__MIG_WORDS[@]}\""
        ;;
    builtin) __MIG_EVAL="__mig_dispatch ${__rest#builtin}" ;;
    set | shopt)
        [[ $__cmd =~ [[:space:]]\+[A-Za-z]*[TCE]|\+o\ (functrace|errtrace|noclobber)|-o\ posix|-u.*extdebug ]] || return 0
        __MIG_EVAL="__mig_record skipped ${__first} \"(turns off what this shell needs)\""
        ;;
    *)
        if [[ $__first =~ ^[][A-Za-z0-9_.:@%,+-]+$ ]]; then
            ((__changed)) && return 0 # a plain name: builtin, function, tool of __MIG_BIN or not found
            __MIG_EVAL=$__cmd
        else
            __MIG_EVAL="__mig_dispatch $__cmd"
        fi
        ;;
    esac
    return 1
}

# [[ ]] cannot be shadowed: its file tests are answered by this machine. Each one of a path that is
# not here is recorded, so that the branch it decided is named.
__mig_file_tests() {
    local __t=$1 __op __word
    while [[ $__t =~ (^|[[:space:]])-([edfrwxsLhS])[[:space:]]+([^][:space:]]+)(.*) ]]; do
        __op=${BASH_REMATCH[2]} __word=${BASH_REMATCH[3]} __t=${BASH_REMATCH[4]}
        [[ $__word == *'$('* || $__word == *'`'* ]] && continue
        eval "__mig_words $__word" 2>/dev/null || continue
        [[ -e ${__MIG_WORDS[0]:-} ]] || __mig_record missing-test "-$__op" "${__MIG_WORDS[0]:-}" "$1"
    done
}

# exec: with a command, the command is recorded and the launcher ends, as exec ends it; with only
# redirections, they apply to this shell (already sent to out/ by __mig_redirect).
__mig_exec() {
    while [[ ${__MIG_WORDS[0]:-} == -[acl]* ]]; do
        [[ ${__MIG_WORDS[0]} == -a ]] && __MIG_WORDS=("${__MIG_WORDS[@]:1}")
        __MIG_WORDS=("${__MIG_WORDS[@]:1}")
    done
    if ((${#__MIG_WORDS[@]})); then
        __mig_dispatch "${__MIG_WORDS[@]}"
        __mig_record exit "exec"
        exit 0
    fi
    eval "$__MIG_EXEC_TEXT"
}

# ---------------------------------------------------------------------------------------------
# Shadows of the builtins that would reach outside this shell or fail on a path that is only on the
# cluster. Each is one line into a __mig_ function, whose own commands the trap lets run.

cd() { __mig_cd "$@"; }
pushd() { __MIG_DIRS+=("$PWD"); __mig_cd "${@: -1}"; }
popd() { __mig_cd "${__MIG_DIRS[-1]:-$PWD}"; unset '__MIG_DIRS[-1]'; }
pwd() { printf '%s\n' "$PWD"; }
source() { __mig_source "$@"; }
.() { __mig_source "$@"; }
test() { __mig_test test "$@"; }
[() { __mig_test [ "$@"; }
read() { __mig_read "$@"; }
command() { __mig_command "$@"; }
declare -a __MIG_DIRS=()

# A folder that is here is entered; one that is not (a path of the cluster) is followed by name only.
__mig_cd() {
    local __to=${*: -1}
    (($#)) || __to=$HOME
    [[ $__to == - ]] && __to=${OLDPWD:-$PWD}
    [[ $__to == -[LPe@] ]] && __to=$HOME
    if [[ -d $__to ]]; then
        builtin cd -- "$__to"
        return
    fi
    [[ $__to == /* ]] || __to="$PWD/$__to"
    __mig_record missing-cd "$__to"
    OLDPWD=$PWD
    PWD=$__to
    return 0
}

__mig_source() {
    local __file=$1
    if [[ $__file != */* ]] && ! [[ -f $__file ]]; then
        __file=$(type -P -- "$__file" 2>/dev/null || printf '%s' "$1")
    fi
    if [[ -f $__file && -r $__file ]]; then
        builtin source "$@"
        return
    fi
    __mig_record missing-source "$1"
    return 0
}

# [ and test: a unary file test of a path that is not here answers as if it were (the launcher
# checks the cluster's data folders); the answer is recorded.
__mig_test() {
    local -a __args=()
    local __how=$1 __prev="(" __a
    shift
    if [[ $__how == "[" ]]; then
        [[ ${*: -1} == "]" ]] || { builtin [ "$@"; return; }
        set -- "${@:1:$#-1}"
    fi
    while (($#)); do
        __a=$1
        shift
        if [[ $__prev == @(\(|!|-a|-o) && $__a == -[edfrwxsLhSpbcgukOGN] ]] && (($#)) && ! [[ -e $1 || -L $1 ]]; then
            __mig_record assumed-test "$__a" "$1"
            __a=-n
        fi
        __args+=("$__a")
        __prev=$__a
    done
    builtin test "${__args[@]}"
}

# read -p prompts a person at a terminal, and a read from /dev/tty reads one: under a scheduler there
# is none. The prompt is recorded and answered with Enter (empty values); any other read reads as
# bash would.
__mig_read() {
    local __a __prompt="" __tty=$__MIG_TTY
    __MIG_TTY=""
    for __a in "$@"; do
        [[ -n $__prompt && $__prompt == next ]] && __prompt=$__a
        [[ $__a == -*p ]] && __prompt=next
        [[ $__a == -*p?* && $__a != --* ]] && __prompt=${__a#*p}
    done
    if [[ -n $__prompt || -n $__tty ]]; then
        __mig_record read-prompt "$__prompt" "${__tty:-0}"
        local __skip=0 __name
        for __a in "$@"; do
            ((__skip)) && { __skip=0; continue; }
            [[ $__a == -[pdinNtua] || $__a == -*[pdinNtua] ]] && { __skip=1; continue; }
            [[ $__a == -* ]] && continue
            printf -v "$__a" '%s' ""
        done
        return 0
    fi
    builtin read "$@"
}

# command -v / -V: every command exists on the cluster; command NAME runs NAME past functions.
__mig_command() {
    case ${1:-} in
    -v | -V | -pv | -vp)
        shift
        local __n
        for __n in "$@"; do
            if [[ $(type -t -- "$__n") == @(builtin|keyword|function) && -z ${__MIG_FACTS[$__n]:-} ]]; then
                printf '%s\n' "$__n"
            else
                printf '/usr/bin/%s\n' "${__n##*/}"
            fi
        done
        ;;
    -p) shift; __mig_command "$@" ;;
    *)
        if [[ ${1:-} == @(cd|pushd|popd|pwd|source|.|test|[|read) ]]; then
            "$@"
        elif [[ $(type -t -- "${1:-}") == builtin ]]; then
            builtin "$@"
        else
            __mig_dispatch "$@"
        fi
        ;;
    esac
}

# ---------------------------------------------------------------------------------------------
# The cluster's facts, as its tools print them.

# Written in one piece, as the real tool's output reaches a pipe: `nvidia-smi ... | head -1` must not
# see a broken pipe.
nvidia-smi() {
    local __a __fields="" __noheader=0 __nounits=0 __one="" __i __f __text="" __value
    local -a __out
    local __next=""
    for __a in "$@"; do
        [[ -n $__next ]] && { printf -v "$__next" '%s' "$__a"; __next=""; continue; }
        case $__a in
        --query-gpu=*) __fields=${__a#*=} ;;
        --format=*) [[ $__a == *noheader* ]] && __noheader=1; [[ $__a == *nounits* ]] && __nounits=1 ;;
        --id=* | -i=*) __one=${__a#*=} ;;
        --id | -i) __next=__one ;;
        -L | --list-gpus) __fields=list ;;
        esac
    done
    __mig_record fact nvidia-smi "$@"
    IFS=, read -ra __f <<<"$__fields"
    if [[ -n $__fields && $__fields != list ]] && ((!__noheader)); then
        __out=()
        for __a in "${__f[@]}"; do
            case $__a in memory.*) __out+=("$__a [MiB]") ;; *) __out+=("$__a") ;; esac
        done
        __text+=$(__mig_join "${__out[@]}")$'\n'
    fi
    for ((__i = 0; __i < __MIG_NGPUS; __i++)); do
        [[ -n $__one && $__one != "$__i" ]] && continue
        if [[ $__fields == list ]]; then
            printf -v __a 'GPU %d: %s (UUID: GPU-00000000-0000-0000-0000-%012d)' "$__i" "$__MIG_GPU_NAME" "$__i"
            __text+=$__a$'\n'
            continue
        elif [[ -z $__fields ]]; then
            printf -v __a '| %d  %s | 0MiB / %dMiB |' "$__i" "$__MIG_GPU_NAME" "$__MIG_GPU_MIB"
            __text+=$__a$'\n'
            continue
        fi
        __out=()
        for __a in "${__f[@]}"; do
            case ${__a// /} in
            memory.total | memory.free) __value=$__MIG_GPU_MIB ;;
            memory.used) __value=0 ;;
            name | gpu_name) __out+=("$__MIG_GPU_NAME"); continue ;;
            count) __out+=("$__MIG_NGPUS"); continue ;;
            index) __out+=("$__i"); continue ;;
            *) __out+=("[N/A]"); continue ;;
            esac
            ((__nounits)) && __out+=("$__value") || __out+=("$__value MiB")
        done
        __text+=$(__mig_join "${__out[@]}")$'\n'
    done
    printf '%s' "$__text"
}

__mig_join() {
    local __line
    printf -v __line '%s, ' "$@"
    printf '%s\n' "${__line%, }"
}

nproc() { printf '%s\n' "$__MIG_CPUS"; }
getconf() {
    case ${1:-} in _NPROCESSORS_ONLN | _NPROCESSORS_CONF) printf '%s\n' "$__MIG_CPUS" ;; *) __mig_record cmd getconf "$@" ;; esac
}
which() {
    local __n
    for __n in "$@"; do [[ $__n == -* ]] || printf '/usr/bin/%s\n' "${__n##*/}"; done
}
hostname() { printf '%s\n' "${__MIG_HOSTNAME:-node0}"; }
# tee copies its input to its output; the files it would write are recorded, not written.
tee() {
    __mig_record cmd tee "$@"
    "$__MIG_BIN/cat"
}
# env NAME=value ... COMMAND: COMMAND with those variables; alone, the exported variables.
env() {
    while [[ ${1:-} == -* ]]; do
        [[ $1 == -u ]] && shift
        shift
    done
    (($#)) || { export -p | sed 's/^declare -x //'; return 0; }
    __mig_dispatch "$@"
}

# How a launcher starts (shell.py's START, at the top level of `bash -c`, so that the launcher is
# sourced outside any function): a -c command string is written to a file of its own first, so that
# the trap tells its commands from this file's; then the trap is set and the file sourced.
__mig_file() {
    __MIG_FILE="$__MIG_DIR/out/bash-c.$BASHPID.$RANDOM"
    printf '%s\n' "$1" >"$__MIG_FILE"
}
__MIG_TRAP='__mig_debug || { __MIG_E=$-; set +e; eval "$__MIG_EVAL"; [[ $__MIG_E != *e* ]] || set -e; ! true; }'
