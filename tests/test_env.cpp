// Environment lookup, the documentation table, and log settings.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "core/env.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "runtime/comm_options.hpp"
#include "runtime/socket.hpp"
#include "runtime/unique_id.hpp"
#include "support/env.hpp"

using namespace tutti;

TEST(Env, EveryVariableIsDocumentedInOneTable) {
  std::ifstream in(std::string(TUTTI_SOURCE_DIR) + "/docs/ENVIRONMENT.md");
  ASSERT_TRUE(in) << "docs/ENVIRONMENT.md is missing";
  std::stringstream ss;
  ss << in.rdbuf();
  std::string doc = ss.str();
  for (const auto& v : env::variables()) {
    EXPECT_NE(doc.find("| `" + std::string(v.name) + "`"), std::string::npos) << v.name << " is not in the table";
    if (!v.alias.empty()) {
      EXPECT_NE(doc.find("`" + std::string(v.alias) + "`"), std::string::npos) << v.alias;
    }
  }
}

TEST(Env, TypedLookupsAndErrorsNameTheVariable) {
  test_support::ScopedEnv vars({{"TUTTI_SHM_SLOTS", "12"}});
  EXPECT_EQ(env::get_int("TUTTI_SHM_SLOTS"), 12);
  vars.set("TUTTI_SHM_SLOTS", "twelve");
  try {
    env::get_int("TUTTI_SHM_SLOTS");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("TUTTI_SHM_SLOTS='twelve'"), std::string::npos) << e.what();
  }
  vars.set("TUTTI_SHM_SLOTS", nullptr);
  EXPECT_EQ(env::get_int("TUTTI_SHM_SLOTS"), 16);  // the declared default
  EXPECT_EQ(env::parse_size("64K"), 65536u);
  EXPECT_EQ(env::parse_size("16M"), 16u << 20);
  EXPECT_EQ(env::parse_size("1G"), 1u << 30);
  EXPECT_THROW(env::parse_size("lots"), InvalidArgument);
  EXPECT_THROW(env::get_string("TUTTI_NOT_DECLARED"), InternalError);
}

TEST(Env, NcclAliasesAreHonouredAndTuttiWins) {
  test_support::ScopedEnv vars({{"TUTTI_DEBUG", nullptr}, {"NCCL_DEBUG", "INFO"}});
  EXPECT_EQ(env::get_string("TUTTI_DEBUG"), "INFO");
  vars.set("TUTTI_DEBUG", "TRACE");
  EXPECT_EQ(env::get_string("TUTTI_DEBUG"), "TRACE");
}

TEST(Log, LevelsAndSubsystemsParseLikeNccl) {
  EXPECT_EQ(log::parse_level("info"), log::Level::kInfo);
  EXPECT_EQ(log::parse_level("VERSION"), log::Level::kVersion);
  EXPECT_EQ(log::parse_level("TRACE"), log::Level::kTrace);
  EXPECT_EQ(log::parse_level(""), log::Level::kNone);
  EXPECT_EQ(log::parse_subsys("INIT,NET"), log::kInit | log::kNet);
  EXPECT_EQ(log::parse_subsys("^SHM"), ~static_cast<uint32_t>(log::kShm));
  EXPECT_EQ(log::parse_subsys("ALL"), static_cast<uint32_t>(log::kAll));
}

TEST(Log, WritesToTheDebugFileWithRankPrefix) {
  std::string path = ::testing::TempDir() + "/tutti-log-%p.txt";
  {
    test_support::ScopedEnv vars(
        {{"TUTTI_DEBUG", "INFO"}, {"TUTTI_DEBUG_SUBSYS", "NET"}, {"TUTTI_DEBUG_FILE", path.c_str()}});
    log::reload();
    log::set_thread_rank(5);
    TUTTI_INFO(log::kNet, "hello {}", 42);
    TUTTI_INFO(log::kShm, "filtered out");
    log::set_thread_rank(-1);
  }
  log::reload();
  std::string real = path.replace(path.find("%p"), 2, std::to_string(getpid()));
  std::ifstream in(real);
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_NE(ss.str().find("[5] TUTTI INFO hello 42"), std::string::npos) << ss.str();
  EXPECT_EQ(ss.str().find("filtered out"), std::string::npos);
}

TEST(Env, SocketIfnameSyntaxMatchesNccl) {
  EXPECT_TRUE(interface_matches("eth", "eth0"));
  EXPECT_FALSE(interface_matches("=eth", "eth0"));
  EXPECT_TRUE(interface_matches("=eth0", "eth0"));
  EXPECT_FALSE(interface_matches("^docker,lo", "lo"));
  EXPECT_TRUE(interface_matches("^docker,lo", "eth0"));
  EXPECT_TRUE(interface_matches("ib,eth", "ib0"));
}

TEST(UniqueIdTest, HexAndHostPortForms) {
  UniqueId id = UniqueId::make(SocketAddress::parse("127.0.0.1:4567"), 0x1234);
  EXPECT_EQ(sizeof(id.bytes), 128u);
  UniqueId back = UniqueId::parse(id.hex(), "");
  EXPECT_EQ(back.bytes, id.bytes);
  EXPECT_EQ(back.root().to_string(), "127.0.0.1:4567");
  EXPECT_EQ(back.secret(), 0x1234u);
  {
    // A bare host:port has no secret of its own: refused without TUTTI_COMM_SECRET, saying how.
    tutti::test_support::ScopedEnv no_secret({{"TUTTI_COMM_SECRET", nullptr}});
    try {
      UniqueId::parse("127.0.0.1:999", CommOptions::from_env().comm_secret);
      ADD_FAILURE() << "a host:port id without TUTTI_COMM_SECRET was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("set the same TUTTI_COMM_SECRET on every rank"), std::string::npos) << e.what();
    }
  }
  tutti::test_support::ScopedEnv secret({{"TUTTI_COMM_SECRET", "s3cr3t"}});
  EXPECT_EQ(CommOptions::from_env().comm_secret, "s3cr3t");
  UniqueId hp = UniqueId::parse("127.0.0.1:999", "s3cr3t");
  EXPECT_EQ(hp.root().port(), 999);
  EXPECT_EQ(hp.secret(), UniqueId::parse("127.0.0.1:999", "s3cr3t").secret());
  EXPECT_EQ(hp.secret(), UniqueId::parse("127.0.0.1:1000", "s3cr3t").secret());  // the secret, not the address
  EXPECT_NE(hp.secret(), UniqueId::parse("127.0.0.1:999", "other").secret());
  EXPECT_THROW(UniqueId::parse("nonsense", "s3cr3t"), InvalidArgument);
  EXPECT_THROW(UniqueId::parse("127.0.0.1:99999", "s3cr3t"), InvalidArgument);
  EXPECT_THROW(UniqueId::parse(std::string(256, 'z'), "s3cr3t"), InvalidArgument);
}
