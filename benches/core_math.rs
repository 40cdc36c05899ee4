//! Cost of the pure core: one evaluation per algorithm, and one policy match, without any
//! locking or IO. Run: `cargo bench --bench core_math`.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use quotamesh::core::policy::{Entry, Match, PolicySet, PolicySource};
use quotamesh::core::rate::{Algorithm, LimitSpec};

fn evaluate(criterion: &mut Criterion) {
    for algorithm in [Algorithm::TokenBucket, Algorithm::SlidingWindow, Algorithm::FixedWindow] {
        let spec = LimitSpec::new(algorithm, 1_000_000, 1000, None).expect("valid limit");
        let mut state = spec.initial_state(0);
        let mut now_ms = 0_u64;
        criterion.bench_function(&format!("evaluate {algorithm:?}"), |bencher| {
            bencher.iter(|| {
                now_ms += 1;
                let evaluation = spec.evaluate(black_box(&state), now_ms, 1);
                state = evaluation.next;
                evaluation.admitted
            });
        });
    }
}

fn policy_match(criterion: &mut Criterion) {
    let text = "domain: bench\ndescriptors:\n  - key: tenant\n    descriptors:\n      - key: path\n        value: /pay\n        rate_limit: {unit: second, requests_per_unit: 10}\n      - key: path\n        value: \"/api*\"\n        rate_limit: {unit: second, requests_per_unit: 10}\n  - key: api_key\n    rate_limit: {unit: second, requests_per_unit: 10}\n";
    let policy =
        PolicySet::parse(&[PolicySource { name: "bench.yaml".to_owned(), text: text.to_owned() }])
            .expect("valid policy");
    let nested = [Entry { key: "tenant", value: "acme" }, Entry { key: "path", value: "/api/v1" }];
    criterion.bench_function("match nested wildcard descriptor", |bencher| {
        bencher.iter(|| {
            matches!(
                black_box(policy.match_descriptor("bench", black_box(&nested))),
                Match::Rule(_)
            )
        });
    });
}

criterion_group!(benches, evaluate, policy_match);
criterion_main!(benches);
