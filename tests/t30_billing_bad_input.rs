//! Bad input to the billing API gets a clear gRPC error and changes nothing: zero and
//! negative-looking amounts, overflowing credits, unknown accounts and holds, oversized or
//! empty keys, missing fields, missing or wrong tokens, another tenant's account, a message
//! or an authorization header past the port's limits.

use common::billing::{
    ADMIN_TOKEN, BillingClient, BillingCluster, T1_TOKEN, account, balance, full_trail,
    open_account, with_token,
};
use quotamesh::api::proto::quotamesh::billing::v1 as pb;
use tonic::Code;
use tonic::transport::Channel;

fn debit(tenant: &str, amount: u64, key: &str) -> pb::DebitRequest {
    pb::DebitRequest {
        account: Some(account(tenant, "api")),
        amount,
        idempotency_key: key.to_owned(),
    }
}

async fn code_of<T>(call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>) -> Code {
    match call.await {
        Ok(_) => Code::Ok,
        Err(status) => {
            assert!(!status.message().is_empty(), "{status:?} has no message");
            status.code()
        }
    }
}

async fn snapshot(client: &mut BillingClient<Channel>) -> anyhow::Result<(u64, u64, usize)> {
    let state = balance(client, "t1", "api").await?;
    Ok((state.balance, state.held, full_trail(client).await?.len()))
}

/// Each bad request gets its code; the balance and the trail are as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_errors_and_change_nothing() -> anyhow::Result<()> {
    let cluster = BillingCluster::start(1, "")?;
    cluster.wait_for_leader(0).await?;
    let mut client = cluster.client(0).await?;
    open_account(&mut client, "t1", "api", 0, 100).await?;
    open_account(&mut client, "t2", "api", 0, 100).await?;
    let before = snapshot(&mut client).await?;
    let c = &mut client;

    // Amounts.
    assert_eq!(
        code_of(c.debit(with_token(debit("t1", 0, "zero"), ADMIN_TOKEN))).await,
        Code::InvalidArgument
    );
    assert_eq!(
        code_of(c.debit(with_token(debit("t1", u64::MAX, "minus-one"), ADMIN_TOKEN))).await,
        Code::InvalidArgument
    );
    assert_eq!(
        code_of(c.debit(with_token(debit("t1", 1 << 63, "min-i64"), ADMIN_TOKEN))).await,
        Code::InvalidArgument
    );
    let huge = pb::CreditRequest {
        account: Some(account("t1", "api")),
        amount: i64::MAX as u64,
        idempotency_key: "big-1".to_owned(),
    };
    assert_eq!(code_of(c.credit(with_token(huge, ADMIN_TOKEN))).await, Code::Ok);
    let overflow = pb::CreditRequest {
        account: Some(account("t1", "api")),
        amount: i64::MAX as u64,
        idempotency_key: "big-2".to_owned(),
    };
    assert_eq!(
        code_of(c.credit(with_token(overflow, ADMIN_TOKEN))).await,
        Code::FailedPrecondition
    );
    // The accepted credit above is the one change this test makes: expect it at the end.
    let before = (before.0 + i64::MAX as u64, before.1, before.2 + 1);
    let reserve = pb::ReserveRequest {
        account: Some(account("t1", "api")),
        amount: 5,
        ttl_ms: 0,
        idempotency_key: "ttl".to_owned(),
    };
    assert_eq!(code_of(c.reserve(with_token(reserve, ADMIN_TOKEN))).await, Code::InvalidArgument);

    // Accounts and holds.
    assert_eq!(
        code_of(c.debit(with_token(debit("t9", 1, "unknown"), ADMIN_TOKEN))).await,
        Code::NotFound
    );
    assert_eq!(
        code_of(c.debit(with_token(debit("t 1", 1, "bad-name"), ADMIN_TOKEN))).await,
        Code::InvalidArgument
    );
    let no_account =
        pb::DebitRequest { account: None, amount: 1, idempotency_key: "none".to_owned() };
    assert_eq!(code_of(c.debit(with_token(no_account, ADMIN_TOKEN))).await, Code::InvalidArgument);
    let void = pb::VoidRequest {
        account: Some(account("t1", "api")),
        hold_id: 4242,
        idempotency_key: "no-hold".to_owned(),
    };
    assert_eq!(code_of(c.void(with_token(void, ADMIN_TOKEN))).await, Code::NotFound);
    let exists = pb::CreateAccountRequest {
        account: Some(account("t1", "api")),
        floor: 0,
        idempotency_key: "again".to_owned(),
    };
    assert_eq!(
        code_of(c.create_account(with_token(exists, ADMIN_TOKEN))).await,
        Code::AlreadyExists
    );

    // Keys.
    let long_key = "k".repeat(129);
    assert_eq!(
        code_of(c.debit(with_token(debit("t1", 1, &long_key), ADMIN_TOKEN))).await,
        Code::InvalidArgument
    );
    assert_eq!(
        code_of(c.debit(with_token(debit("t1", 1, ""), ADMIN_TOKEN))).await,
        Code::InvalidArgument
    );
    assert_eq!(
        code_of(c.debit(with_token(debit("t1", 1, "with space"), ADMIN_TOKEN))).await,
        Code::InvalidArgument
    );

    // Credentials.
    assert_eq!(
        code_of(c.debit(with_token(debit("t1", 1, "wrong"), "not-a-token"))).await,
        Code::Unauthenticated
    );
    assert_eq!(
        code_of(c.debit(tonic::Request::new(debit("t1", 1, "missing")))).await,
        Code::Unauthenticated
    );
    assert_eq!(
        code_of(c.debit(with_token(debit("t2", 1, "other-tenant"), T1_TOKEN))).await,
        Code::PermissionDenied
    );
    let other_balance = pb::GetBalanceRequest { account: Some(account("t2", "api")) };
    assert_eq!(
        code_of(c.get_balance(with_token(other_balance, T1_TOKEN))).await,
        Code::PermissionDenied
    );
    let other_entries =
        pb::ListEntriesRequest { account: Some(account("t2", "api")), ..Default::default() };
    assert_eq!(
        code_of(c.list_entries(with_token(other_entries, T1_TOKEN))).await,
        Code::PermissionDenied
    );
    let big_page = pb::ListEntriesRequest { page_size: 5000, ..Default::default() };
    assert_eq!(
        code_of(c.list_entries(with_token(big_page, ADMIN_TOKEN))).await,
        Code::InvalidArgument
    );

    // A tenant token lists only its own tenant's entries.
    let own =
        c.list_entries(with_token(pb::ListEntriesRequest::default(), T1_TOKEN)).await?.into_inner();
    assert!(own.entries.iter().all(|e| e.account.as_ref().is_some_and(|a| a.tenant == "t1")));
    assert!(!own.entries.is_empty());

    // Past the port's limits: RESOURCE_EXHAUSTED naming the sizes, not UNKNOWN or OUT_OF_RANGE.
    let mut big = c.clone().max_encoding_message_size(4 * 1024 * 1024);
    let oversized = debit("t1", 1, &"k".repeat(2 * 1024 * 1024));
    let status = big.debit(with_token(oversized, ADMIN_TOKEN)).await.expect_err("2 MiB");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("message length too large"), "{status:?}");
    let long_token = "t".repeat(60 * 1024);
    let status =
        c.debit(with_token(debit("t1", 1, "long-token"), &long_token)).await.expect_err("60 KiB");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("request metadata is"), "{status:?}");

    assert_eq!(snapshot(&mut client).await?, before);
    Ok(())
}
