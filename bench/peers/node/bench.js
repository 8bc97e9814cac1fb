// node bench.js REDIS_URL SECONDS [IN_FLIGHT]: decisions per second through
// rate-limiter-flexible's RateLimiterRedis (10k keys, never reached), with
// IN_FLIGHT (50) in flight; prints "decisions/s N".
const Redis = require('ioredis');
const { RateLimiterRedis } = require('rate-limiter-flexible');

async function main() {
  const [url = 'redis://127.0.0.1:6379/', seconds = '5', inFlight = '50'] = process.argv.slice(2);
  const redis = new Redis(url, { enableOfflineQueue: false });
  await new Promise((resolve) => redis.once('ready', resolve));
  const limiter = new RateLimiterRedis({ storeClient: redis, keyPrefix: 'rlf', points: 1000000, duration: 1 });
  const until = Date.now() + Number(seconds) * 1000;
  let done = 0;
  const worker = async (task) => {
    for (let i = task; Date.now() < until; i += Number(inFlight)) {
      await limiter.consume(`k${i % 10000}`, 1).then(() => { done += 1; }, () => {});
    }
  };
  await Promise.all(Array.from({ length: Number(inFlight) }, (_, task) => worker(task)));
  console.log(`decisions/s ${Math.round(done / Number(seconds))}`);
  redis.disconnect();
}

main().catch((e) => { console.error(e); process.exit(1); });
