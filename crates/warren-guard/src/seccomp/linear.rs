//! The filter as it was compiled before the decision tree (test-only): the
//! ABI fence, then the `Refuse` rules, then the `Absent` rules, each group
//! built by seccompiler (default ALLOW, one comparison per system call in
//! a row) and chained to the next by turning its ALLOW returns into jumps
//! past its end, then the allowlist as a row of ranges. Kept as the
//! reference the tree must answer exactly like.

use std::collections::BTreeMap;
use std::error::Error;

use seccompiler::{
    SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

use super::{
    abi_fence, check_one_rule_per_syscall, errno_action, jump, stmt, syscall_number, Answer, BpfProgram, Delivery,
    DenyRule, Profile, When, BPF_JA, BPF_JGE_K, BPF_JGT_K, BPF_LD_W_ABS, BPF_MAXINSNS, BPF_RET_K, DATA_NR,
    X86_64_SYSCALLS,
};

/// The old `compile`.
pub(super) fn compile(profile: &Profile<'_>, delivery: Delivery) -> Result<BpfProgram, Box<dyn Error>> {
    let rules = profile.rules;
    check_one_rule_per_syscall(rules)?;
    let refusal = match delivery {
        Delivery::Notify => libc::SECCOMP_RET_USER_NOTIF,
        Delivery::Errno => errno_action(libc::EPERM),
    };
    let mut groups = Vec::new();
    for answer in [Answer::Refuse, Answer::Absent] {
        let chosen: Vec<&DenyRule> = rules.iter().filter(|r| r.answer == answer).collect();
        if chosen.is_empty() {
            continue;
        }
        let mut group = seccompiler_program(&chosen, answer)?;
        if answer == Answer::Refuse {
            rewrite_returns(&mut group, errno_action(libc::EPERM), refusal);
        }
        groups.push(group);
    }
    if let Some(allowed) = profile.allowed {
        let unknown = match delivery {
            Delivery::Notify => libc::SECCOMP_RET_USER_NOTIF,
            Delivery::Errno => errno_action(libc::ENOSYS),
        };
        groups.push(allowlist(allowed, refusal, unknown)?);
    }
    let mut program = abi_fence(refusal);
    program.extend(chain(groups));
    assert!(program.len() <= BPF_MAXINSNS);
    Ok(program)
}

/// The allowlist as the last group: ALLOW for `allowed`, `refusal` for the
/// other calls of the kernel's table, `unknown` for every other number.
fn allowlist(allowed: &[&'static str], refusal: u32, unknown: u32) -> Result<BpfProgram, Box<dyn Error>> {
    let numbers =
        allowed.iter().map(|name| syscall_number(name).ok_or("unknown syscall")).collect::<Result<Vec<_>, _>>()?;
    let known: Vec<i64> = X86_64_SYSCALLS.iter().map(|(_, nr)| *nr).collect();
    let mut program = vec![stmt(BPF_LD_W_ABS, DATA_NR)];
    program.extend(range_checks(&ranges(numbers), libc::SECCOMP_RET_ALLOW));
    if refusal != unknown {
        program.extend(range_checks(&ranges(known), refusal));
    }
    program.push(stmt(BPF_RET_K, unknown));
    Ok(program)
}

/// Sorted, merged runs of consecutive numbers.
fn ranges(mut numbers: Vec<i64>) -> Vec<(u32, u32)> {
    numbers.sort_unstable();
    numbers.dedup();
    let mut out: Vec<(u32, u32)> = Vec::new();
    for nr in numbers {
        let nr = nr as u32;
        match out.last_mut() {
            Some((_, hi)) if *hi + 1 == nr => *hi = nr,
            _ => out.push((nr, nr)),
        }
    }
    out
}

/// Returns `hit` when the loaded number is in one of `ranges` (sorted);
/// otherwise falls through to the instruction after the checks.
fn range_checks(ranges: &[(u32, u32)], hit: u32) -> BpfProgram {
    let mut out = Vec::with_capacity(ranges.len() * 4);
    for (i, &(lo, hi)) in ranges.iter().enumerate() {
        let later = (ranges.len() - i - 1) * 4;
        out.push(jump(BPF_JGT_K, hi, 3, 0));
        out.push(jump(BPF_JGE_K, lo, 0, 1));
        out.push(stmt(BPF_RET_K, hit));
        out.push(stmt(BPF_JA, later as u32));
    }
    out
}

/// One seccompiler filter for rules that share an answer: their calls
/// return `SECCOMP_RET_ERRNO | answer.errno()`, everything else ALLOW.
fn seccompiler_program(rules: &[&DenyRule], answer: Answer) -> Result<BpfProgram, Box<dyn Error>> {
    let mut by_number = BTreeMap::new();
    for rule in rules {
        let number = syscall_number(rule.syscall).ok_or("unknown syscall")?;
        by_number.insert(number, seccompiler_rules(&rule.when)?);
    }
    let filter = SeccompFilter::new(
        by_number,
        SeccompAction::Allow,
        SeccompAction::Errno(answer.errno() as u32),
        TargetArch::x86_64,
    )?;
    let program: seccompiler::BpfProgram = filter.try_into()?;
    Ok(program.iter().map(|i| jump(i.code, i.k, i.jt, i.jf)).collect())
}

/// The conditions of one rule, as seccompiler rules (any one matching
/// refuses the call; an empty list refuses it always).
fn seccompiler_rules(when: &When) -> Result<Vec<SeccompRule>, Box<dyn Error>> {
    let dword =
        |arg: u8, op: SeccompCmpOp, value: u32| SeccompCondition::new(arg, SeccompCmpArgLen::Dword, op, value.into());
    let rules = match *when {
        When::Always => Vec::new(),
        When::AnyFlag { arg, flags } => flags
            .iter()
            .map(|flag| SeccompRule::new(vec![dword(arg, SeccompCmpOp::MaskedEq(flag.value.into()), flag.value)?]))
            .collect::<Result<_, _>>()?,
        When::NotOneOf { arg, allowed } => {
            let conditions = allowed.iter().map(|v| dword(arg, SeccompCmpOp::Ne, *v)).collect::<Result<_, _>>()?;
            vec![SeccompRule::new(conditions)?]
        }
        When::IoctlCommand(commands) => commands
            .iter()
            .map(|c| SeccompRule::new(vec![dword(1, SeccompCmpOp::Eq, c.command)?]))
            .collect::<Result<_, _>>()?,
    };
    Ok(rules)
}

/// Replaces every `ret from` by `ret to`.
fn rewrite_returns(program: &mut BpfProgram, from: u32, to: u32) {
    for insn in program.iter_mut().filter(|i| i.code == BPF_RET_K && i.k == from) {
        insn.k = to;
    }
}

/// Concatenates filters: in every one but the last, `ret ALLOW` becomes a
/// jump to the first instruction after it, i.e. to the next filter.
fn chain(groups: Vec<BpfProgram>) -> BpfProgram {
    let count = groups.len();
    let mut out = Vec::new();
    for (i, mut group) in groups.into_iter().enumerate() {
        if i + 1 < count {
            let len = group.len();
            for (at, insn) in group.iter_mut().enumerate() {
                if insn.code == BPF_RET_K && insn.k == libc::SECCOMP_RET_ALLOW {
                    *insn = stmt(BPF_JA, (len - 1 - at) as u32);
                }
            }
        }
        out.extend(group);
    }
    out
}

#[test]
fn ranges_merge_runs_and_the_checks_find_each_number() {
    assert_eq!(ranges(vec![5, 1, 2, 3, 9, 10, 3]), vec![(1, 3), (5, 5), (9, 10)]);
}
