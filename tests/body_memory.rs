//! `key::ReadBody` holds at most its bound of memory, however finely the
//! body is cut: a body of 16,000 one-byte chunks, each a slice of a larger
//! buffer (as hyper's chunks of a body dripped a byte per segment are),
//! reaches the inner service as one frame, with the memory live then
//! measured by a counting global allocator (this test binary's own).

use std::alloc::{GlobalAlloc, Layout, System};
use std::convert::Infallible;
use std::sync::atomic::{AtomicIsize, Ordering};

use axum::body::{Body, Bytes};
use http::Request;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_ratelimit::key::ReadBody;

/// The bytes allocated and not yet freed, by the whole process.
static LIVE: AtomicIsize = AtomicIsize::new(0);

struct Counting;

// SAFETY: every call is forwarded to the system allocator unchanged; only
// the sizes are counted.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const BODY: usize = 16_000;
/// The buffer each one-byte chunk is a slice of.
const SEGMENT: usize = 512;

/// `BODY` chunks of one byte, each holding a buffer of `SEGMENT` bytes.
fn dripped() -> Body {
    let chunks =
        (0..BODY).map(|_| Ok::<_, Infallible>(Bytes::from(vec![b'x'; SEGMENT]).slice(0..1)));
    Body::from_stream(futures::stream::iter(chunks))
}

#[tokio::test(flavor = "current_thread")]
async fn a_body_dripped_a_byte_per_chunk_is_held_in_one_buffer_of_at_most_the_bound() {
    let read = ReadBody::new().max_bytes(BODY);
    let before = LIVE.load(Ordering::Relaxed);
    let inner = tower::service_fn(move |request: Request<Body>| async move {
        // the body as the inner service gets it, before it reads any of it
        let held = LIVE.load(Ordering::Relaxed) - before;
        let mut body = request.into_body();
        let (mut frames, mut bytes) = (0, 0);
        while let Some(frame) = body.frame().await {
            let frame = frame.expect("a frame");
            if let Some(data) = frame.data_ref() {
                frames += 1;
                bytes += data.len();
            }
        }
        Ok::<_, Infallible>((held, frames, bytes))
    });
    let request = Request::post("/").body(dripped()).expect("a request");
    let (held, frames, bytes) = tower_layer::Layer::layer(&read, inner)
        .oneshot(request)
        .await
        .expect("answered");
    eprintln!("{held} bytes held for a body of {BODY} bytes, replayed in {frames} frames");
    assert_eq!(bytes, BODY, "the body reaches the inner service whole");
    // the buffer (16,000 bytes) and a few small allocations of the request
    assert!(
        held < 3 * BODY as isize,
        "{held} bytes held for a body of {BODY} bytes ({} per byte)",
        held / BODY as isize
    );
    assert_eq!(frames, 1, "what was read is replayed as one frame");
}
