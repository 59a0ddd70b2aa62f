use super::*;
use std::thread;

/// `members` mappings of one fresh segment.
fn lanes(members: usize, tag: &str) -> Vec<Lane> {
    let path = format!("/dev/shm/perseus-test-lane-{}-{tag}", std::process::id());
    let segs: Vec<_> = (0..members)
        .map(|_| Arc::new(Segment::open(&path, layout(members)).unwrap()))
        .collect();
    let _ = std::fs::remove_file(&path);
    segs.into_iter()
        .enumerate()
        .map(|(m, s)| Lane::new(s, m).unwrap())
        .collect()
}

fn ident(h: u64, len: usize) -> Identity {
    Identity {
        hashes: [h, !h],
        len,
    }
}

/// Member `m`'s attempt at an exchange of 8 bytes: its value, and the sum of all.
fn sum(lane: &Lane, h: u64, value: u64, patience: Duration) -> Option<u64> {
    lane.exchange(
        ident(h, 8),
        |b| b.copy_from_slice(&value.to_le_bytes()),
        patience,
        true,
        |parts| {
            parts
                .iter()
                .map(|p| u64::from_le_bytes(p[..8].try_into().unwrap()))
                .sum()
        },
    )
}

#[test]
fn every_member_gets_every_part_over_many_attempts() {
    for members in [2, 3, 4] {
        let all = lanes(members, &format!("many{members}"));
        let got: Vec<Vec<Option<u64>>> = thread::scope(|s| {
            let hs: Vec<_> = all
                .iter()
                .enumerate()
                .map(|(m, lane)| {
                    s.spawn(move || {
                        (0..500u64)
                            .map(|i| sum(lane, i, i * 10 + m as u64, Duration::from_secs(5)))
                            .collect()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let n = members as u64;
        for (m, mine) in got.iter().enumerate() {
            for (i, v) in mine.iter().enumerate() {
                let want = n * i as u64 * 10 + n * (n - 1) / 2;
                assert_eq!(*v, Some(want), "member {m} of {members}, attempt {i}");
            }
        }
    }
}

#[test]
fn a_member_that_never_comes_is_given_up_within_the_patience() {
    let all = lanes(2, "absent");
    let start = Instant::now();
    assert_eq!(sum(&all[0], 1, 1, Duration::from_millis(20)), None);
    assert!(start.elapsed() < Duration::from_secs(2));
    // The late member finds the attempt given up and does not wait at all.
    let start = Instant::now();
    assert_eq!(sum(&all[1], 1, 2, Duration::from_secs(30)), None);
    assert!(start.elapsed() < Duration::from_secs(2));
    // Both then meet at the next attempt.
    let got = thread::scope(|s| {
        let a = s.spawn(|| sum(&all[0], 2, 5, Duration::from_secs(5)));
        let b = s.spawn(|| sum(&all[1], 2, 7, Duration::from_secs(5)));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(got, (Some(12), Some(12)));
}

#[test]
fn different_identities_are_given_up_by_all() {
    let all = lanes(3, "differ");
    let got: Vec<Option<u64>> = thread::scope(|s| {
        let hs: Vec<_> = all
            .iter()
            .enumerate()
            .map(|(m, lane)| {
                // Member 2 means another operation.
                s.spawn(move || sum(lane, if m == 2 { 9 } else { 4 }, 1, Duration::from_secs(5)))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, vec![None, None, None]);
    // Lengths may differ where the hashes agree: each part comes with its own.
    let lens: Vec<Vec<usize>> = thread::scope(|s| {
        let hs: Vec<_> = all
            .iter()
            .enumerate()
            .map(|(m, lane)| {
                s.spawn(move || {
                    let fill = move |b: &mut [u8]| b.fill(m as u8 + 1);
                    let then = |parts: &[&[u8]]| {
                        for (q, p) in parts.iter().enumerate() {
                            assert!(p.iter().all(|&x| x == q as u8 + 1));
                        }
                        parts.iter().map(|p| p.len()).collect()
                    };
                    lane.exchange(
                        ident(5, 8 * (m + 1)),
                        fill,
                        Duration::from_secs(5),
                        true,
                        then,
                    )
                    .unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(lens, vec![vec![8, 16, 24]; 3]);
}

#[test]
fn members_out_of_step_agree_on_every_attempt() {
    // Member 1 comes to each attempt after a pause that sometimes outlasts
    // member 0's patience: each attempt ends the same way on both, and never
    // waits longer than the patience.
    let all = lanes(2, "skew");
    let (a, b): (Vec<_>, Vec<_>) = thread::scope(|s| {
        let a = s.spawn(|| {
            (0..200u64)
                .map(|i| sum(&all[0], i, 1, Duration::from_micros(200)))
                .collect::<Vec<_>>()
        });
        let b = s.spawn(|| {
            (0..200u64)
                .map(|i| {
                    if i % 3 == 0 {
                        thread::sleep(Duration::from_micros(400));
                    }
                    sum(&all[1], i, 2, Duration::from_micros(200))
                })
                .collect::<Vec<_>>()
        });
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(a, b, "both members settle every attempt alike");
    assert!(a.iter().all(|v| v.is_none() || *v == Some(3)));
}

#[test]
fn no_lane_beyond_its_members() {
    assert_eq!(bytes(MAX_MEMBERS + 1), 0);
    let path = format!("/dev/shm/perseus-test-lane-{}-big", std::process::id());
    let seg = Arc::new(Segment::open(&path, layout(MAX_MEMBERS + 1)).unwrap());
    let _ = std::fs::remove_file(&path);
    assert!(Lane::new(seg, 0).is_none());
}

#[test]
fn a_member_left_behind_catches_up() {
    // Member 1 made three attempts member 0 never made (each given up after its
    // patience): at its next attempt member 0 skips to member 1's, and they meet.
    let all = lanes(2, "behind");
    for i in 0..3 {
        assert_eq!(sum(&all[1], 100 + i, 1, Duration::from_millis(1)), None);
    }
    let got = thread::scope(|s| {
        let a = s.spawn(|| sum(&all[0], 7, 5, Duration::from_secs(5)));
        let b = s.spawn(|| sum(&all[1], 7, 7, Duration::from_secs(5)));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(got, (Some(12), Some(12)));
    // And stay in step.
    let got = thread::scope(|s| {
        let a = s.spawn(|| sum(&all[0], 8, 1, Duration::from_secs(5)));
        let b = s.spawn(|| sum(&all[1], 8, 2, Duration::from_secs(5)));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(got, (Some(3), Some(3)));
}

#[test]
fn a_member_one_attempt_behind_joins_the_one_waiting_ahead() {
    // Member 1 made one attempt member 0 never made; it now waits in its next one.
    // Member 0 comes later to its own next (one behind) and joins member 1 there.
    let all = lanes(2, "one-behind");
    assert_eq!(sum(&all[1], 100, 1, Duration::from_millis(1)), None);
    let got = thread::scope(|s| {
        let b = s.spawn(|| sum(&all[1], 7, 7, Duration::from_secs(5)));
        // Until member 1 waits in attempt 1.
        while all[1].slot_word(1).load(Ordering::Acquire) & BITS == 0 {
            std::hint::spin_loop();
        }
        let a = s.spawn(|| sum(&all[0], 7, 5, Duration::from_secs(5)));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(got, (Some(12), Some(12)));
}

#[test]
fn a_declined_attempt_is_given_up_at_once_and_the_next_is_met() {
    let all = lanes(2, "decline");
    let got = thread::scope(|s| {
        // Member 0 waits with a long patience; member 1 declines that attempt.
        let a = s.spawn(|| {
            let start = Instant::now();
            let first = sum(&all[0], 1, 1, Duration::from_secs(30));
            (first, start.elapsed())
        });
        thread::sleep(Duration::from_millis(20));
        all[1].decline();
        let (first, waited) = a.join().unwrap();
        assert_eq!(first, None);
        assert!(waited < Duration::from_secs(10), "waited {waited:?}");
        // Both then meet at the next attempt, in step.
        let a = s.spawn(|| sum(&all[0], 2, 5, Duration::from_secs(5)));
        let b = s.spawn(|| sum(&all[1], 2, 7, Duration::from_secs(5)));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(got, (Some(12), Some(12)));
    // A member that declines first: the other finds the attempt passed and does not wait.
    all[0].decline();
    let start = Instant::now();
    assert_eq!(sum(&all[1], 3, 1, Duration::from_secs(30)), None);
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_member_waited_for_from_this_cpu_makes_the_wait_give_way() {
    let all = lanes(2, "crowd");
    let on = |cpu: usize| {
        // SAFETY: a zeroed cpu_set_t is empty; CPU_SET and sched_setaffinity only
        // touch it and this thread's affinity.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
        }
    };
    thread::scope(|s| {
        s.spawn(|| {
            assert!(on(0), "this test runs where CPU 0 may be used");
            // Neither member has said where it runs: nothing to give way to.
            assert!(!all[0].crowded(|_| true));
            all[1].arrive(0);
            assert!(all[0].crowded(|_| true), "member 1 came from this CPU");
            assert!(
                !all[0].crowded(|_| false),
                "but member 0 does not wait for it"
            );
            all[1].cpu(1).store(u64::MAX, Ordering::Relaxed);
            assert!(!all[0].crowded(|_| true), "member 1 on another CPU");
        })
        .join()
        .unwrap();
    });
}

#[test]
fn a_member_that_stepped_away_is_not_waited_for_until_it_is_back() {
    let all = lanes(2, "away");
    all[1].step_away();
    let start = Instant::now();
    assert_eq!(sum(&all[0], 1, 1, Duration::from_secs(30)), None);
    assert!(start.elapsed() < Duration::from_secs(10));
    assert_eq!(sum(&all[0], 2, 1, Duration::from_millis(1)), None);
    // Member 0 joins too, which ends the join. Back (each one's next attempt says so),
    // member 1 skips the attempts member 0 made meanwhile, and both meet at once.
    all[0].step_away();
    let got = thread::scope(|s| {
        let b = s.spawn(|| sum(&all[1], 3, 7, Duration::from_secs(5)));
        thread::sleep(Duration::from_millis(20));
        let a = s.spawn(|| sum(&all[0], 3, 5, Duration::from_secs(5)));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(got, (Some(12), Some(12)));
}
